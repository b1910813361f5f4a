"""Errors cross the bus as themselves: the class a retry decision reads survives the trip."""

import pytest

from shared.errors import (
    _ALL,
    InstanceLost,
    NoCapacity,
    PeerUnreachable,
    Refused,
    Unavailable,
    from_reply,
)
from shared.messages.api import ErrorReply
from shared.messages.base import decoder_for, encode


@pytest.mark.parametrize("cls", _ALL, ids=lambda c: c.__name__)
def test_every_error_is_rebuilt_as_its_own_class(cls) -> None:
    sent = cls("why", param="p", retry_after_s=1.5).to_reply()
    back = from_reply(decoder_for(ErrorReply).decode(encode(sent)))
    assert type(back) is cls
    assert (back.message, back.param, back.retry_after_s) == ("why", "p", 1.5)
    assert back.status == cls.status and back.retryable == cls.retryable


def test_the_retry_classes_are_all_503s_a_client_may_retry() -> None:
    for cls in (PeerUnreachable, Refused, NoCapacity, InstanceLost):
        assert issubclass(cls, Unavailable) and cls.status == 503 and cls.retryable
    # Told apart by class, not code: a refusal did nothing there, an unanswered call may have.
    assert not issubclass(Refused, PeerUnreachable) and not issubclass(PeerUnreachable, Refused)


def test_a_reply_without_a_kind_falls_back_to_its_status() -> None:
    old = ErrorReply(status=503, code="whatever", message="busy", retryable=True)
    assert type(from_reply(old)) is Unavailable
    assert type(from_reply(ErrorReply(status=418, code="x", message="?"))).__name__ == "Internal"
