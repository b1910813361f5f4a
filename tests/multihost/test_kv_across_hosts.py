"""Prompt KV and weights between hosts: the layout of ``test_multihost`` (three hosts, each
its own network namespace and its own /dev/shm, so they share nothing but the links; two
TEs a host):

- ``demo2`` (the demo checkpoint), two instances on two hosts (placement spreads a model's
  instances), serves colocated: a prompt sharing a long prefix with an earlier one is
  placed on the instance holding that prefix by whichever job executor takes it, from
  either frontend (the prompt index is the cluster's, not a host's), and its usage counts
  the cached tokens;
- ``demo`` (the same checkpoint), one instance, disaggregates prompts with over 256 uncached
  tokens: its first long prompts make the scaler add a prefill instance, which spreading puts
  on another host; the decode instance then pulls each prompt's KV from it over TCP (no
  shared memory between hosts), and the greedy tokens equal the colocated ones of ``demo2``;
- ``demo3`` (the demo model with every weight nudged, so no host cache holds any of its
  tensors through the others), loaded on one host and then scaled out by a burst: its
  second instance, on another host, forks the weights from the first one's host cache over
  the link, and the rate is reported against the link's."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from devtools.multihost import HTTP_PORT, LAYOUT, MultiHostCluster, host_of
from devtools.netns_hosts import Hosts
from tests.multihost.conftest import start_cluster

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

FRONTENDS = [i for i, s in LAYOUT.items() if "frontend" in s]
PD_HEADER = "x-meshserve-pd"
MAX_TOKENS = 12
SETTINGS = {
    "min_replicas": "0",
    "max_replicas": "1",
    "model_scaling": json.dumps(
        {
            "demo": {"min_replicas": 1, "max_replicas": 1, "max_prefill_replicas": 1},
            "demo2": {"min_replicas": 2, "max_replicas": 2},
            "demo3": {"min_replicas": 0, "max_replicas": 2},
        }
    ),
    "pd": "auto",
    "pd_min_uncached_tokens": "256",
    "keep_alive": "600",
    "max_num_seqs": "2",  # a burst of a few streams scales a model out
    "preload_window": "0",  # a pool's cache gets a model only by loading it (or a fork)
    "log_format": "json",  # the TEs' load records, read back (MultiHostCluster.loads)
}
DOCUMENTS = 6


def _document(k: int) -> str:
    """About 800 tokens of the demo tokenizer, different for each ``k``."""
    return f"Document {k}. " + " ".join(f"w{(7 * j + 13 * k) % 997}" for j in range(360))


@pytest.fixture(scope="module")
def kv_models(mh_models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``mh_models_dir`` and ``demo3``: the demo model with every weight scaled by 1.001
    (its own tensors, as a different checkpoint has), its configuration and tokenizer."""
    from safetensors.torch import load_file, save_file

    d = tmp_path_factory.mktemp("kv-models")
    for m in mh_models_dir.iterdir():
        (d / m.name).symlink_to(m.resolve())
    src, dst = mh_models_dir / "demo", d / "demo3"
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            save_file({k: v * 1.001 for k, v in load_file(f).items()}, dst / f.name)
        else:
            (dst / f.name).symlink_to(f.resolve())
    return d


@pytest.fixture(scope="module")
def kv(hosts: Hosts, kv_models: Path) -> Iterator[MultiHostCluster]:
    c = start_cluster(hosts, kv_models, **SETTINGS)
    try:
        c.wait("every host's TEs in the view", lambda: _tes(c) == 6, 240)
        c.wait(
            "demo2 on two hosts, demo on one",
            lambda: len(_ready(c, "demo2")) == 2 and len(_ready(c, "demo")) == 1,
            180,
        )
        yield c
    finally:
        c.stop()


def _tes(c: MultiHostCluster) -> int:
    return len((c.health(FRONTENDS[0]) or {}).get("task_executors", []))


def _ready(c: MultiHostCluster, model: str, role: str | None = None) -> list[dict]:
    return [
        te
        for te in (c.health(FRONTENDS[0]) or {}).get("task_executors", [])
        if te.get("model") == model
        and te["state"] == "ready"
        and (role is None or te["role"] == role)
    ]


def _client(c: MultiHostCluster, i: int) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=c.url(i), api_key="none", max_retries=0, timeout=120)


async def _chat(client: openai.AsyncOpenAI, model: str, prompt: str) -> tuple[str, int, str]:
    """Greedy text, the prompt tokens the instance's cache held, and how it was placed."""
    raw = await client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    r = raw.parse()
    assert r.usage is not None and r.usage.completion_tokens == MAX_TOKENS
    details = r.usage.prompt_tokens_details
    cached = details.cached_tokens or 0 if details is not None else 0
    return r.choices[0].message.content or "", cached, raw.headers.get(PD_HEADER, "")


async def test_a_shared_prefix_finds_its_instance_from_any_frontend(
    kv: MultiHostCluster,
) -> None:
    """Documents each asked about first through one frontend and then through the other: the
    second question is placed where the document's KV is (most of its prompt cached),
    whichever host that instance and the placing job executor are on (by chance, each would
    land there half the time)."""
    pools = {te["pool"] for te in _ready(kv, "demo2")}
    assert len(pools) == 2, pools  # one instance a host
    for k in range(DOCUMENTS):
        first = _client(kv, FRONTENDS[k % 2])
        second = _client(kv, FRONTENDS[(k + 1) % 2])
        _, cached, _ = await _chat(first, "demo2", _document(k) + " What is the first word?")
        assert cached < 64, cached  # nobody had seen it
        # The job executors learn what a TE caches from its KV events (batched every 50 ms,
        # over NATS): a question asked the instant the answer ends can beat them.
        await asyncio.sleep(1)
        _, cached, _ = await _chat(second, "demo2", _document(k) + " What is the last word?")
        assert cached >= 700, (k, cached)


async def test_kv_moves_between_hosts_for_a_disaggregated_prompt(kv: MultiHostCluster) -> None:
    """The prefill instance the scaler adds is on another host than the decode instance;
    each disaggregated prompt's KV crosses the link by TCP, and the tokens are the
    colocated ones."""
    (decode,) = _ready(kv, "demo")
    client = _client(kv, FRONTENDS[0])
    # Long prompts with no prefill instance: colocated, and the prefill work they would have
    # sent makes the scaler add one.
    deadline = time.monotonic() + 120
    k = 10
    while not _ready(kv, "demo", "prefill"):
        assert time.monotonic() < deadline, "no prefill instance was loaded"
        await _chat(client, "demo", _document(k))
        k += 1
    (prefill,) = _ready(kv, "demo", "prefill")
    assert prefill["pool"] != decode["pool"], (prefill, decode)

    prompts = [_document(100 + j) for j in range(4)]
    colocated = [await _chat(_client(kv, FRONTENDS[1]), "demo2", p) for p in prompts]
    disaggregated = []
    for p in prompts:
        # A job executor weighs the prefill instance's queue as its last heartbeat (every
        # 0.25 s) told it, besides its own placements: the prompt the other job executor
        # just had prefilled there would still count, and send this one to prefill locally
        # ("prefill queue longer").
        await asyncio.sleep(0.6)
        disaggregated.append(await _chat(client, "demo", p))
    assert all(how.startswith("disaggregated") for _, _, how in disaggregated), disaggregated
    assert [t for t, _, _ in disaggregated] == [t for t, _, _ in colocated]

    tcp = kv.metric(
        FRONTENDS[0], HTTP_PORT, "meshserve_kv_transfer_bytes_total", model="demo", transport="tcp"
    )
    shm = kv.metric(
        FRONTENDS[0], HTTP_PORT, "meshserve_kv_transfer_bytes_total", model="demo", transport="shm"
    )
    assert tcp is not None and tcp > 0 and not shm, (tcp, shm)
    print(
        f"prefill on {prefill['pool']}, decode on {decode['pool']}: {tcp / 1e6:.2f} MB of KV "
        f"over TCP for {len(prompts)} prompts"
    )


async def test_a_second_instance_forks_the_weights_from_another_hosts_cache(
    kv: MultiHostCluster,
) -> None:
    """``demo3``'s first instance loads from disk into its host's cache; a burst adds a
    second on another host, which forks the weights from that cache over the link."""
    client = _client(kv, FRONTENDS[0])
    await _chat(client, "demo3", "Hello there.")
    (first,) = _ready(kv, "demo3")

    kv.wait(
        "the first instance's host cache holds demo3",
        lambda: kv.holds_weights(FRONTENDS[0], "demo3", first["id"]),
        60,
    )
    deadline = time.monotonic() + 180
    while len(_ready(kv, "demo3")) < 2:
        assert time.monotonic() < deadline, "the burst was not given a second instance"
        await asyncio.gather(*(_chat(client, "demo3", _document(200 + i)) for i in range(6)))
    second = next(te for te in _ready(kv, "demo3") if te["id"] != first["id"])
    assert second["pool"] != first["pool"], (first, second)
    fork = kv.fork("demo3", host_of(second))
    assert fork is not None, kv.loads()
    print(
        f"demo3 ({fork['checkpoint_bytes'] / 1e6:.1f} MB) forked from {first['pool']} to "
        f"{second['pool']} across the {kv.hosts.shaping.rate} link in "
        f"{fork['fetch_s'] * 1000:.0f} ms ({fork['rate_bytes_s'] / 1e6:.0f} MB/s, "
        f"{100 * fork['of_link']:.1f}% of the link)"
    )
