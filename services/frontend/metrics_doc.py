"""The README's table of every metric family meshserve serves at ``/metrics`` (the
frontend's, and each node pool's for its TEs), generated from the metrics themselves (each
is defined beside what measures it), so that the table cannot drift: ``python -m services.frontend.metrics_doc README.md`` rewrites it between its
markers (``scripts/gen-docs`` does), and a test fails when it is stale."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase

BEGIN, END = "<!-- metrics:begin (scripts/gen-docs) -->", "<!-- metrics:end -->"
SUFFIX = {"counter": "_total", "gauge": "", "histogram": "", "summary": "", "info": "_info"}


# Where each service defines its metrics (module-level prometheus_client metrics); a test
# checks that no registered metric is defined anywhere else.
MODULES: dict[str, tuple[str, ...]] = {
    "frontend": (
        "services.frontend.request_metrics",
        "services.frontend.accounting",
        "services.frontend.answer",
        "services.frontend.middleware",
        "services.frontend.rate_limits",
        "services.frontend.streaming",
    ),
    "job executor": ("services.job_executor.metrics",),
    "cluster manager": ("services.cluster_manager.metrics",),
    "scaler": ("services.scaler.metrics",),
    "node pool": ("services.task_executor.device_arbiter",),
    "every service": ("shared.infra_metrics",),
}


def families() -> list[tuple[str, str, tuple[str, ...], str, str]]:
    """(name as exposed, type, labels, help, served by) of every family meshserve serves:
    each service's module-level metrics, and a node pool's (its TEs', ``pool_metrics``)."""
    from services.task_executor.pool_metrics import SPECS

    out = []
    for service, modules in MODULES.items():
        for module in modules:
            for metric in vars(importlib.import_module(module)).values():
                if isinstance(metric, MetricWrapperBase):
                    kind = str(metric._type)
                    name = metric._name + SUFFIX.get(kind, "")
                    doc = metric._documentation
                    out.append((name, kind, tuple(metric._labelnames), doc, service))
    for kind, name, doc, labels in SPECS.values():
        out.append((name + SUFFIX.get(kind, ""), kind, labels, doc, "node pool"))
    return sorted(set(out))


def table() -> str:
    rows = ["| metric | type | labels | served by | what |", "|---|---|---|---|---|"]
    for name, kind, labels, doc, where in families():
        rows.append(f"| `{name}` | {kind} | {', '.join(labels) or '-'} | {where} | {doc} |")
    return "\n".join(rows)


def rewrite(text: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + table() + "\n" + text[end:]


def main() -> None:
    path = Path(sys.argv[1])
    path.write_text(rewrite(path.read_text()))


if __name__ == "__main__":
    main()
