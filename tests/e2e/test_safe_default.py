"""Safe by default off one host: `meshserve up` with the frontend listening beyond loopback
(MESHSERVE_HTTP_HOST=0.0.0.0, auth left at its default) generates an admin key into a file
only its user reads, and the API and its admin routes answer nobody without a key; on
loopback the local default stays open. (Traffic goes to 127.0.0.1 only.)"""

from __future__ import annotations

import json
import stat
import urllib.error
import urllib.request

import openai
import pytest

from tests.e2e.conftest import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.nats, pytest.mark.redis]


def _status(base: str, path: str, key: str | None = None) -> int:
    req = urllib.request.Request(base + path)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            json.loads(r.read())
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_beyond_loopback_auth_is_on_with_a_generated_admin_key(
    e2e_models_dir, nats_url, redis_url, tmp_path
) -> None:
    key_file = tmp_path / "admin-key"
    c = Cluster(
        e2e_models_dir, nats_url, redis_url, http_host="0.0.0.0", admin_key_file=str(key_file)
    ).start()
    try:
        key = key_file.read_text().strip()
        assert key.startswith("sk-ms-") and stat.S_IMODE(key_file.stat().st_mode) == 0o600
        base = f"http://127.0.0.1:{c.port}"
        for path in ("/admin/keys", "/admin/tenants", "/v1/models"):
            assert _status(base, path) == 401, path
        assert _status(base, "/admin/tenants", "sk-ms-" + "x" * 43) == 401
        assert _status(base, "/admin/keys", key) == 200
        assert _status(base, "/health") == 200  # probes stay open
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)
        r = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert r.usage is not None and r.usage.completion_tokens > 0
    finally:
        c.stop()


def test_on_loopback_the_local_default_stays_open(cluster_up) -> None:
    base = cluster_up.url.removesuffix("/v1")
    assert base.startswith("http://127.0.0.1:")
    assert _status(base, "/admin/tenants") == 200
    assert _status(base, "/v1/models") == 200
