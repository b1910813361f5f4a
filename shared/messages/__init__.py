"""Wire types, one module per family. Every message is a tagged msgspec Struct.

New fields are appended with defaults so old readers keep working.
"""

from shared.messages.base import Message, decoder_for, encode

__all__ = ["Message", "decoder_for", "encode"]
