"""The README's table of every metric family meshserve serves at ``/metrics`` (the
frontend's, and each node pool's for its TEs), generated from the metrics themselves (each
is defined beside what measures it), so that the table cannot drift: ``python -m services.frontend.metrics_doc README.md`` rewrites it between its
markers (``scripts/gen-docs`` does), and a test fails when it is stale."""

from __future__ import annotations

import sys
from pathlib import Path

from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase

BEGIN, END = "<!-- metrics:begin (scripts/gen-docs) -->", "<!-- metrics:end -->"
SUFFIX = {"counter": "_total", "gauge": "", "histogram": "", "summary": "", "info": "_info"}


def families() -> list[tuple[str, str, tuple[str, ...], str, str]]:
    """(name as exposed, type, labels, help, served by) of every family meshserve serves:
    the frontend's (its registry's, once its modules are imported) and a node pool's (its
    TEs', ``pool_metrics``)."""
    import services.frontend.service  # noqa: F401  (every metric module, imported)
    from services.task_executor.pool_metrics import SPECS

    out = []
    seen: set[int] = set()
    for collector in list(REGISTRY._collector_to_names):
        if not isinstance(collector, MetricWrapperBase) or id(collector) in seen:
            continue
        seen.add(id(collector))
        kind = str(collector._type)
        name = collector._name + SUFFIX.get(kind, "")
        labels = tuple(collector._labelnames)
        out.append((name, kind, labels, collector._documentation, "frontend"))
    for kind, name, doc, labels in SPECS.values():
        out.append((name + SUFFIX.get(kind, ""), kind, labels, doc, "node pool"))
    return sorted(out)


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
