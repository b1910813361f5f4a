"""A node pool's TEs in vLLM's engine families (``vllm:num_requests_running`` and the rest,
with ``meshserve:`` for ``vllm:``), served at the node pool's ``/metrics``: read at each
scrape from the TEs' latest heartbeats as the cluster view carries them, labelled
``model_name``, ``engine`` and ``te``; and the pool's TEs by state."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shared.messages.cluster import ClusterView, TEState

LABELS = ("model_name", "engine", "te")
# key: (type, name, help, labels)
SPECS: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "running": (
        "gauge",
        "meshserve:num_requests_running",
        "Requests in the engine's batch",
        LABELS,
    ),
    "waiting": (
        "gauge",
        "meshserve:num_requests_waiting",
        "Requests a TE accepted that wait for the engine's batch",
        LABELS,
    ),
    "kv": ("gauge", "meshserve:kv_cache_usage_perc", "KV cache in use, 0 to 1", LABELS),
    "queries": (
        "counter",
        "meshserve:prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache since the model loaded",
        LABELS,
    ),
    "hits": (
        "counter",
        "meshserve:prefix_cache_hits",
        "Prompt tokens found in the prefix cache (not computed) since the model loaded",
        LABELS,
    ),
    "states": ("gauge", "meshserve:task_executors", "This node pool's TEs by state", ("state",)),
}


def _families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
    kinds = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}
    return {
        key: kinds[kind](name, doc, labels=list(labels))
        for key, (kind, name, doc, labels) in SPECS.items()
    }


class PoolCollector(Collector):
    def __init__(self, pool_id: str, view: Callable[[], ClusterView]) -> None:
        self._pool_id, self._view = pool_id, view

    def describe(self) -> Iterator[Metric]:
        yield from _families().values()

    def collect(self) -> Iterator[Metric]:
        f = _families()
        tes = [te for te in self._view().tes if te.pool_id == self._pool_id]
        for state in TEState:
            f["states"].add_metric([str(state)], sum(1 for te in tes if te.state == state))
        for te in tes:
            if te.model is None or not te.total_kv_blocks:
                continue  # no engine: nothing of vLLM's families to say
            labels = [te.model, te.engine or "", te.te_id]
            f["running"].add_metric(labels, te.running)
            f["waiting"].add_metric(labels, te.waiting)
            f["kv"].add_metric(labels, 1 - te.free_kv_blocks / te.total_kv_blocks)
            f["queries"].add_metric(labels, te.prefix_cache_queries)
            f["hits"].add_metric(labels, te.prefix_cache_hits)
        yield from f.values()
