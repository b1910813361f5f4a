"""A TE's part in prefill/decode disaggregation (PD).

Prefill side (a TE loaded as ``prefill``): a prefill task's prompt runs with one output token
and a KV sink; its KV streams, layer by layer as the engine computes it, into an ``Outbox``
offered on this TE's KV server under a lease. The decode TE pulls it, renewing the lease
while it waits, and releases it; the KV is freed then, or when the lease ends any other way
(the decode TE went silent, dropped the connection or said no): never while a puller may
still read it (vLLM #21570), never left stranded for minutes (the lease, not a fixed timeout).

Decode side (``colocated`` or ``decode``): a decode task pulls its prompt's KV from the
prefill TE its ``KvSource`` names, asking only for the tokens past the prefix its own cache
holds, then continues the request from it. A pull that fails or stalls falls back per
``MESHSERVE_PD_FALLBACK``: the decode TE prefills the prompt itself, or the request ends with
a 502. Bytes go TE to TE (``kv_transport``: shared memory on one host, else TCP); NATS only
carries the tasks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import msgspec

from services.task_executor.dtypes import dtype_name
from services.task_executor.engines.base import EngineRequest
from services.task_executor.engines.capabilities import KvExporter, KvImporter
from services.task_executor.engines.torch_engine.kv_transfer import KvExport
from services.task_executor.kv_transport.client import Pulled, TransferFailed, pull
from services.task_executor.kv_transport.outbox import Outbox
from services.task_executor.kv_transport.pool import default_pool
from services.task_executor.kv_transport.server import KvServer
from shared.logging import get_logger
from shared.messages.tasks import KvSource
from shared.settings import Settings

log = get_logger(__name__)


class PrefillSide:
    """This TE's KV server and the prompts it holds for decode TEs, by prefill task key."""

    def __init__(self, settings: Settings, on_end: Callable[[str, str], None]) -> None:
        """``on_end(key, reason)``: a prompt's lease ended (released, rejected, disconnected,
        expired, withdrawn): free its KV."""
        te = settings.task_executor
        self._lease_s = te.pd_lease.total_seconds()
        # Leases ended, by how (the heartbeat's kv_lease_ends): the reason's kind only
        # ("rejected: <why>" counts as "rejected"), so the counts stay a handful of keys.
        self.ends: dict[str, int] = {}

        def ended(key: str, reason: str) -> None:
            kind = reason.partition(":")[0]
            self.ends[kind] = self.ends.get(kind, 0) + 1
            on_end(key, reason)

        self._server = KvServer(host=te.kv_host, on_end=ended)
        self._arenas = default_pool(te.kv_arena_pool_bytes)
        self._started = False

    @property
    def address(self) -> str:
        return self._server.address if self._started else ""

    async def start(self) -> None:
        if not self._started:
            await self._server.start()
            self._started = True

    def offer(self, key: str, exporter: KvExporter, prompt_tokens: int) -> Outbox:
        """A new prompt's outbox, offered now (its lease runs from here)."""
        layout = exporter.kv_layout
        outbox = Outbox(
            key,
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            dtype=layout.dtype,
            num_prompt_tokens=prompt_tokens,
            lease_s=self._lease_s,
            arenas=self._arenas,
        )
        self._server.offer(outbox)
        return outbox

    def withdraw(self, key: str, reason: str) -> None:
        self._server.withdraw(key, reason)

    async def close(self) -> None:
        if self._started:
            await self._server.close()


@dataclasses.dataclass(frozen=True, slots=True)
class Imported:
    """A decode task's prompt KV, pulled: what the engine imports, and the tokens the prefill
    TE produced (they go to the client first). From a prefill TE on this host, the KV is
    read in place in its arena, under a lease that ends once the engine has copied it into
    its cache and dropped every view of it (``kv_transport.client``)."""

    export: KvExport
    head: list[int]  # tokens past the prompt, produced by the prefill TE
    finish_reason: str | None  # the prefill's token already ended the request
    pulled: Pulled


async def pull_prompt(
    source: KvSource,
    prompt: Sequence[int],
    importer: KvImporter,
    settings: Settings,
) -> Imported:
    """The prompt's KV from the prefill TE, past what this TE's cache holds. Raises
    ``TransferFailed`` (the caller falls back)."""
    te = settings.task_executor
    held = importer.held_prefix_tokens(prompt)
    pulled = await pull(
        source.address,
        source.key,
        skip_tokens=held,
        deadline_s=te.pd_transfer_timeout.total_seconds(),
        renew_s=te.pd_lease.total_seconds() / 3,
    )
    if pulled.token_ids[: pulled.num_prompt_tokens] != list(prompt):
        raise TransferFailed("the prefill TE computed another prompt")
    L, _, n, kvh, hd = pulled.kv.shape
    export = KvExport(
        token_ids=list(pulled.token_ids),
        num_prompt_tokens=pulled.num_prompt_tokens,
        num_computed_tokens=pulled.num_computed_tokens,
        block_size=1,
        num_layers=L,
        num_kv_heads=kvh,
        head_dim=hd,
        dtype=dtype_name(pulled.dtype),
        # The prefill TE serves the same model by name; its weights' fingerprint does not
        # travel with the pull (the job executor pairs instances of one model only).
        model_fingerprint=importer.model_fingerprint,
        kv=pulled.kv.reshape(L, 2, n, 1, kvh, hd),
        first_token=pulled.first_token,
    )
    return Imported(
        export=export,
        head=list(pulled.token_ids[pulled.num_prompt_tokens :]),
        finish_reason=pulled.finish_reason,
        pulled=pulled,
    )


def prefill_request(request: EngineRequest) -> EngineRequest:
    """The request a prefill TE runs: the prompt and its first token."""
    return msgspec.structs.replace(
        request, sampling=msgspec.structs.replace(request.sampling, max_tokens=1)
    )
