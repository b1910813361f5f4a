"""The base of every wire message and the msgpack codec used on the bus."""

from __future__ import annotations

from functools import cache
from typing import Any, Union

import msgspec


class Message(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    """A bus message. The tag (the class name) lets a receiver decode a union of types
    and dispatch on the concrete class through a table."""


_encoder = msgspec.msgpack.Encoder()


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


@cache
def decoder_for(*types: type[Message]) -> msgspec.msgpack.Decoder[Any]:
    """A decoder for one message type or a tagged union of several."""
    target: Any = types[0] if len(types) == 1 else Union[types]  # noqa: UP007
    return msgspec.msgpack.Decoder(target)
