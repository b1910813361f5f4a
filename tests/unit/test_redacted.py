"""Secrets in server URLs never reach a log line or an error message."""

from __future__ import annotations

import pytest

from shared.errors import Unavailable
from shared.store import Store, redacted


def test_credentials_are_cut_from_urls():
    assert redacted("redis://fe:s3cret@127.0.0.1:6379/0") == "redis://***@127.0.0.1:6379/0"
    assert redacted("redis://:s3cret@h/1") == "redis://***@h/1"
    assert redacted("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


async def test_an_unreachable_redis_is_named_without_its_password():
    with pytest.raises(Unavailable) as e:
        await Store.connect("redis://fe:s3cret@127.0.0.1:1/0")
    assert "s3cret" not in str(e.value) and "127.0.0.1:1" in str(e.value)
