"""Safe by default off one host (``shared.tenancy.auth_on``): auth is off only where the
frontend listens on loopback alone, unless the operator says ``MESHSERVE_AUTH`` explicitly;
a frontend beyond loopback without an admin key refuses to start."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.frontend.auth import Authenticator
from shared.settings import Settings
from shared.tenancy import TenantStore, auth_on, loopback_only


@pytest.mark.parametrize(
    ("host", "only"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),  # every interface
        ("10.1.2.3", False),
        ("meshserve.example", False),
    ],
)
def test_only_loopback_addresses_are_loopback(host: str, only: bool) -> None:
    assert loopback_only(host) is only


@pytest.mark.parametrize(
    ("mode", "host", "on"),
    [
        (None, "127.0.0.1", False),  # the open local default
        (None, "0.0.0.0", True),  # compose, containers, a LAN address: keys asked for
        (None, "10.1.2.3", True),
        ("off", "0.0.0.0", False),  # open beyond loopback only when said explicitly
        ("on", "127.0.0.1", True),
    ],
)
def test_auth_is_on_wherever_the_frontend_listens_beyond_loopback(
    mode: str | None, host: str, on: bool
) -> None:
    env = {"MESHSERVE_HTTP_HOST": host} | ({"MESHSERVE_AUTH": mode} if mode else {})
    assert auth_on(Settings.load(env)) is on


def test_a_frontend_beyond_loopback_without_an_admin_key_refuses_to_start(tmp_path: Path) -> None:
    env = {"MESHSERVE_HTTP_HOST": "0.0.0.0", "MESHSERVE_ADMIN_KEY_FILE": str(tmp_path / "none")}
    tenants = TenantStore.__new__(TenantStore)  # never used: the check comes first
    with pytest.raises(SystemExit, match=r"beyond loopback.*MESHSERVE_AUTH=off"):
        Authenticator(Settings.load(env), tenants)
    # With a key it starts, asking for keys; explicitly open, it starts open.
    (tmp_path / "key").write_text("sk-ms-" + "k" * 43)
    env["MESHSERVE_ADMIN_KEY_FILE"] = str(tmp_path / "key")
    assert Authenticator(Settings.load(env), tenants).enabled
    assert not Authenticator(Settings.load(env | {"MESHSERVE_AUTH": "off"}), tenants).enabled
