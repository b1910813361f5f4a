"""The Files API with the official ``openai`` client, on a real frontend (auth on) and Redis:
upload, list, retrieve, download and delete a fine-tuning file; another tenant's file is a
404; a malformed file is a 400 naming its line and leaves nothing behind; a file past the
size limit or the tenant's quota is a 413, and deleting frees the quota."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from services.frontend.service import Frontend
from shared.settings import Settings
from shared.store import Store
from shared.tenancy import TenantStore
from tests.integration.services import Running, wait_health

pytestmark = [pytest.mark.nats, pytest.mark.redis]

ADMIN = "sk-admin-files-test-0123456789"


def _jsonl(*pairs: tuple[str, str]) -> bytes:
    lines = [
        json.dumps(
            {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        )
        for q, a in pairs
    ]
    return ("\n".join(lines) + "\n").encode()


GOOD = _jsonl(("What is the colour of the zorblax?", "Ultraviolet, always."), ("Hi", "Hello"))


async def test_files_api_with_the_official_client(
    cluster: str, nats_url: str, redis_url: str, tmp_path: Path
) -> None:
    from shared.embedded import free_port

    files_dir = tmp_path / "files"
    settings = Settings(
        cluster=cluster,
        nats_url=nats_url,
        redis_url=redis_url,
        models_dir=tmp_path,
        http_port=free_port(),
        auth="on",
        admin_key=ADMIN,
        files_dir=str(files_dir),
        files_max_bytes=4000,
        files_quota_bytes=5000,
    )
    run = Running(settings, nats_url)
    store = await Store.connect(redis_url)
    keys = await Store.connect(redis_url)
    try:
        await run.start(lambda bus: Frontend(settings=settings, bus=bus, store=store))
        base = f"http://127.0.0.1:{settings.frontend.http_port}"
        await wait_health(base, lambda body: True)
        tenants = TenantStore(keys, cluster)
        _, acme_key = await tenants.create_key("acme", "ci")
        _, globex_key = await tenants.create_key("globex", "ci")

        def client(key: str) -> openai.AsyncOpenAI:
            return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)

        acme, globex, admin = client(acme_key), client(globex_key), client(ADMIN)

        f = await acme.files.create(file=("train.jsonl", GOOD), purpose="fine-tune")
        assert f.id.startswith("file-") and f.object == "file"
        assert (f.bytes, f.filename, f.purpose, f.status) == (
            len(GOOD),
            "train.jsonl",
            "fine-tune",
            "processed",
        )
        assert [x.id for x in (await acme.files.list()).data] == [f.id]
        assert (await acme.files.retrieve(f.id)).bytes == len(GOOD)
        assert (await acme.files.content(f.id)).content == GOOD
        assert (files_dir / f.id).read_bytes() == GOOD

        # Another tenant: the same 404 as a missing file; its own list is empty.
        for call in (globex.files.retrieve, globex.files.content, globex.files.delete):
            with pytest.raises(openai.NotFoundError):
                await call(f.id)
        assert (await globex.files.list()).data == []
        assert [x.id for x in (await admin.files.list()).data] == [f.id]  # the admin sees all

        # A malformed file: 400 naming the line; nothing listed, nothing left on disk.
        bad = GOOD + b'{"messages": [{"role": "user", "content": "no answer"}]}\n'
        with pytest.raises(openai.BadRequestError) as e:
            await acme.files.create(file=("bad.jsonl", bad), purpose="fine-tune")
        assert "line 3" in str(e.value) and "assistant" in str(e.value)
        with pytest.raises(openai.BadRequestError) as e:
            await acme.files.create(file=("bad.jsonl", b"{not json\n"), purpose="fine-tune")
        assert "line 1: not valid JSON" in str(e.value)
        with pytest.raises(openai.BadRequestError):
            await acme.files.create(file=("x.jsonl", GOOD), purpose="batch")
        assert [x.id for x in (await acme.files.list()).data] == [f.id]
        assert sorted(p.name for p in files_dir.iterdir()) == [f.id]

        # Past the size limit (4,000 bytes), and past the tenant's quota (5,000).
        big = _jsonl(*[("q" * 40, "a" * 40)] * 50)
        assert len(big) > 4000
        with pytest.raises(openai.APIStatusError) as e:
            await acme.files.create(file=("big.jsonl", big), purpose="fine-tune")
        assert e.value.status_code == 413
        mid = _jsonl(*[("q" * 40, "a" * 40)] * 22)
        assert 2000 < len(mid) < 4000
        second = await acme.files.create(file=("mid.jsonl", mid), purpose="fine-tune")
        with pytest.raises(openai.APIStatusError) as e:
            await acme.files.create(file=("mid2.jsonl", mid), purpose="fine-tune")
        assert e.value.status_code == 413 and "quota" in str(e.value)
        # Another tenant's quota is its own.
        assert (await globex.files.create(file=("g.jsonl", mid), purpose="fine-tune")).bytes
        # Deleting frees it.
        deleted = await acme.files.delete(second.id)
        assert deleted.deleted and deleted.id == second.id
        with pytest.raises(openai.NotFoundError):
            await acme.files.retrieve(second.id)
        assert not (files_dir / second.id).exists()
        assert (await acme.files.create(file=("mid2.jsonl", mid), purpose="fine-tune")).bytes

        # Pages, oldest first.
        page = await acme.files.list(limit=1, order="asc")
        assert [x.id for x in page.data] == [f.id] and page.has_more
    finally:
        await run.stop()
        await keys.close()
