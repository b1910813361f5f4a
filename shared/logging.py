"""structlog setup: readable in a terminal, JSON lines in production. request_id and
service are bound as context so one request can be followed across processes; a line
written inside a span carries its trace_id and span_id (``shared/tracing.py``)."""

from __future__ import annotations

import logging
import sys

import structlog

from shared.tracing import ids


def setup_logging(*, service: str, fmt: str = "console", level: str = "info") -> None:
    lvl = logging.getLevelNamesMapping()[level.upper()]
    renderer: structlog.typing.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _trace_ids,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
    logging.basicConfig(level=max(lvl, logging.WARNING), stream=sys.stderr)


def _trace_ids(
    _logger: object, _method: str, event: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    event.update(ids())
    return event


def get_logger(name: str | None = None) -> structlog.typing.FilteringBoundLogger:
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(name)
    return logger
