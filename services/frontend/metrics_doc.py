"""The README's table of every metric family the frontend serves at ``/metrics``, generated
from the metrics themselves (each is defined beside what measures it), so that the table
cannot drift: ``python -m services.frontend.metrics_doc README.md`` rewrites it between its
markers (``scripts/gen-docs`` does), and a test fails when it is stale."""

from __future__ import annotations

import sys
from pathlib import Path

from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase

BEGIN, END = "<!-- metrics:begin (scripts/gen-docs) -->", "<!-- metrics:end -->"
SUFFIX = {"counter": "_total", "gauge": "", "histogram": "", "summary": "", "info": "_info"}


def families() -> list[tuple[str, str, tuple[str, ...], str]]:
    """(name as exposed, type, labels, help) of every family the frontend registers."""
    import services.frontend.service  # noqa: F401  (every metric module, imported)

    out = []
    seen: set[int] = set()
    for collector in list(REGISTRY._collector_to_names):
        if not isinstance(collector, MetricWrapperBase) or id(collector) in seen:
            continue
        seen.add(id(collector))
        kind = str(collector._type)
        name = collector._name + SUFFIX.get(kind, "")
        labels = tuple(collector._labelnames)
        out.append((name, kind, labels, collector._documentation))
    return sorted(out)


def table() -> str:
    rows = ["| metric | type | labels | what |", "|---|---|---|---|"]
    for name, kind, labels, doc in families():
        rows.append(f"| `{name}` | {kind} | {', '.join(labels) or '-'} | {doc} |")
    return "\n".join(rows)


def rewrite(text: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + table() + "\n" + text[end:]


def main() -> None:
    path = Path(sys.argv[1])
    path.write_text(rewrite(path.read_text()))


if __name__ == "__main__":
    main()
