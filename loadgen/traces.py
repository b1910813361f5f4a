"""Request traces, read into one plain record type.

Every reader here is pure: a file in, a list of ``TraceRequest`` out, sorted by arrival, with
arrivals in seconds from the first request. Nothing here knows about HTTP or tokenizers, so
the replay tool and a simulator read traces the same way.

Formats, detected from the file's first line (``detect_format``):

| format | looks like | arrival | prefix sharing |
|---|---|---|---|
| ``azure`` | CSV ``TIMESTAMP,ContextTokens,GeneratedTokens`` (Azure LLM inference 2023/2024) | datetime string | none |
| ``burstgpt`` | CSV ``Timestamp,Model,Request tokens,Response tokens,...`` (+ ``Session ID``) | seconds | none |
| ``mooncake`` | JSONL ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids`` | ms | 512 tokens per hash id |
| ``bailian`` | JSONL ``chat_id``, ``parent_chat_id``, ``timestamp`` (s), ..., ``turn``, ``hash_ids`` | seconds | 16 tokens per hash id |
| ``meshserve`` | JSONL ``arrival_s``, ... (what ``meshserve-loadgen synth`` writes) | seconds | ``block_size`` per line |
"""

from __future__ import annotations

import csv
import dataclasses
import json
from collections.abc import Iterable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

MOONCAKE_BLOCK = 512
BAILIAN_BLOCK = 16
FORMATS = ("azure", "burstgpt", "mooncake", "bailian", "meshserve")


class TraceError(ValueError):
    """A trace that cannot be read; the message names the file and the reason."""


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    ``hash_ids[i]`` names the content of prompt tokens ``[i*block_size, (i+1)*block_size)``;
    two requests whose ``hash_ids`` agree on the first k ids have the same first
    ``k*block_size`` prompt tokens. ``session_id`` groups the turns of one conversation where
    the format records them (Bailian: the root chat; BurstGPT: ``Session ID``; synth)."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    model: str | None = None
    hash_ids: tuple[int, ...] = ()
    block_size: int = 0
    session_id: str | None = None
    turn: int | None = None
    request_id: str | None = None
    parent_id: str | None = None
    kind: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The ``meshserve`` JSONL line for this request (defaults left out)."""
        out: dict[str, Any] = {
            "arrival_s": round(self.arrival_s, 6),
            "input_length": self.input_tokens,
            "output_length": self.output_tokens,
        }
        for f in ("model", "session_id", "turn", "request_id", "parent_id", "kind"):
            if (v := getattr(self, f)) is not None:
                out[f] = v
        if self.hash_ids:
            out["hash_ids"] = list(self.hash_ids)
            out["block_size"] = self.block_size
        return out


# --------------------------------------------------------------------------- detection


def _first_line(path: Path) -> str:
    try:
        with open(path, encoding="utf-8-sig") as f:
            for line in f:
                if line.strip():
                    return line.strip()
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not a text file ({e.reason})") from e
    raise TraceError(f"{path}: empty file")


def detect_format(path: Path) -> str:
    """The format of the trace at ``path``, from its first non-empty line."""
    path = Path(path)
    line = _first_line(path)
    if line.startswith("{"):
        try:
            keys = set(json.loads(line))
        except (json.JSONDecodeError, TypeError) as e:
            raise TraceError(f"{path}: first line is not a JSON object: {e}") from e
        if "arrival_s" in keys:
            return "meshserve"
        if "chat_id" in keys or "parent_chat_id" in keys:
            return "bailian"
        if {"timestamp", "input_length", "output_length"} <= keys:
            return "mooncake"
        raise TraceError(f"{path}: unknown JSONL trace (keys {sorted(keys)})")
    header = {h.strip().lower() for h in next(csv.reader([line]))}
    if {"timestamp", "contexttokens", "generatedtokens"} <= header:
        return "azure"
    if {"timestamp", "request tokens", "response tokens"} <= header:
        return "burstgpt"
    raise TraceError(f"{path}: unknown trace format (first line {line[:80]!r})")


# --------------------------------------------------------------------------- parsing helpers


def parse_datetime_s(text: str) -> float:
    """Seconds since the epoch (UTC taken as given) of an Azure ``TIMESTAMP``, such as
    ``2023-11-16 18:15:46.6805900``: Python before 3.11 rejects 7 fractional digits, so the
    fraction is parsed separately and kept to the nanosecond."""
    text = text.strip()
    main, _, frac = text.partition(".")
    tz = ""
    for sep in ("+", "Z"):
        if sep in frac:
            frac, _, rest = frac.partition(sep)
            tz = sep + rest
    dt = datetime.fromisoformat(main.replace("T", " ") + (tz.replace("Z", "+00:00") if tz else ""))
    if dt.tzinfo is None:
        seconds = (dt - datetime(1970, 1, 1)).total_seconds()
    else:
        seconds = dt.timestamp()
    if frac:
        if not frac.isdigit():
            raise ValueError(f"bad fractional seconds in {text!r}")
        seconds += int(frac) / 10 ** len(frac)
    return seconds


def _time_s(value: str) -> float:
    """A numeric timestamp in seconds, or a datetime string."""
    try:
        return float(value)
    except ValueError:
        return parse_datetime_s(value)


def _int(value: Any, field: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{field} is a boolean")
    if isinstance(value, int):
        return value
    f = float(str(value).strip())
    if f != int(f):
        raise ValueError(f"{field}={value!r} is not a whole number")
    return int(f)


def _str_or_none(value: Any) -> str | None:
    if value is None:
        return None
    s = str(value).strip()
    return s or None


# --------------------------------------------------------------------------- readers


def _csv_rows(path: Path) -> Iterator[tuple[int, dict[str, str]]]:
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        reader.fieldnames = [h.strip().lower() for h in reader.fieldnames or []]
        for row in reader:
            if not any((v or "").strip() for v in row.values()):
                continue
            yield reader.line_num, row


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(path, encoding="utf-8-sig") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{path}:{n}: not JSON: {e.msg}") from e
            if not isinstance(obj, dict):
                raise TraceError(f"{path}:{n}: not a JSON object")
            yield n, obj


def _azure(path: Path) -> Iterator[TraceRequest]:
    for n, row in _csv_rows(path):
        yield _row(
            path,
            n,
            lambda row=row: TraceRequest(
                arrival_s=_time_s(row["timestamp"]),
                input_tokens=_int(row["contexttokens"], "ContextTokens"),
                output_tokens=_int(row["generatedtokens"], "GeneratedTokens"),
            ),
        )


def _burstgpt(path: Path) -> Iterator[TraceRequest]:
    for n, row in _csv_rows(path):
        yield _row(
            path,
            n,
            lambda row=row: TraceRequest(
                arrival_s=_time_s(row["timestamp"]),
                input_tokens=_int(row["request tokens"], "Request tokens"),
                output_tokens=_int(row["response tokens"], "Response tokens"),
                model=_str_or_none(row.get("model")),
                session_id=_str_or_none(row.get("session id")),
                kind=_str_or_none(row.get("log type")),
            ),
        )


def _mooncake(path: Path) -> Iterator[TraceRequest]:
    for n, obj in _jsonl_rows(path):
        yield _row(
            path,
            n,
            lambda obj=obj: TraceRequest(
                arrival_s=float(obj["timestamp"]) / 1000.0,
                input_tokens=_int(obj["input_length"], "input_length"),
                output_tokens=_int(obj["output_length"], "output_length"),
                hash_ids=tuple(_int(h, "hash_ids") for h in obj.get("hash_ids") or ()),
                block_size=MOONCAKE_BLOCK if obj.get("hash_ids") else 0,
                model=_str_or_none(obj.get("model")),
            ),
        )


def _bailian(path: Path) -> Iterator[TraceRequest]:
    for n, obj in _jsonl_rows(path):

        def make(obj: dict[str, Any] = obj) -> TraceRequest:
            parent = obj.get("parent_chat_id")
            parent_id = None if parent in (None, -1, "-1") else str(parent)
            return TraceRequest(
                arrival_s=float(obj["timestamp"]),
                input_tokens=_int(obj["input_length"], "input_length"),
                output_tokens=_int(obj["output_length"], "output_length"),
                hash_ids=tuple(_int(h, "hash_ids") for h in obj.get("hash_ids") or ()),
                block_size=BAILIAN_BLOCK if obj.get("hash_ids") else 0,
                request_id=_str_or_none(obj.get("chat_id")),
                parent_id=parent_id,
                turn=_int(obj["turn"], "turn") if obj.get("turn") is not None else None,
                kind=_str_or_none(obj.get("type")),
                model=_str_or_none(obj.get("model")),
            )

        yield _row(path, n, make)


def _meshserve(path: Path) -> Iterator[TraceRequest]:
    for n, obj in _jsonl_rows(path):
        yield _row(
            path,
            n,
            lambda obj=obj: TraceRequest(
                arrival_s=float(obj["arrival_s"]),
                input_tokens=_int(obj["input_length"], "input_length"),
                output_tokens=_int(obj["output_length"], "output_length"),
                model=_str_or_none(obj.get("model")),
                hash_ids=tuple(_int(h, "hash_ids") for h in obj.get("hash_ids") or ()),
                block_size=_int(obj.get("block_size") or 0, "block_size"),
                session_id=_str_or_none(obj.get("session_id")),
                turn=_int(obj["turn"], "turn") if obj.get("turn") is not None else None,
                request_id=_str_or_none(obj.get("request_id")),
                parent_id=_str_or_none(obj.get("parent_id")),
                kind=_str_or_none(obj.get("kind")),
            ),
        )


def _row(path: Path, line: int, make: Any) -> TraceRequest:
    """One record, or a TraceError naming the file, the line and the field."""
    try:
        req = make()
    except KeyError as e:
        raise TraceError(f"{path}:{line}: missing field {e.args[0]!r}") from e
    except (ValueError, TypeError) as e:
        raise TraceError(f"{path}:{line}: {e}") from e
    if req.input_tokens < 0 or req.output_tokens < 0:
        raise TraceError(f"{path}:{line}: negative token count")
    if req.hash_ids and req.block_size <= 0:
        raise TraceError(f"{path}:{line}: hash_ids without a positive block_size")
    return req


_READERS = {
    "azure": _azure,
    "burstgpt": _burstgpt,
    "mooncake": _mooncake,
    "bailian": _bailian,
    "meshserve": _meshserve,
}


def _sessions(reqs: list[TraceRequest]) -> list[TraceRequest]:
    """Bailian names a turn's parent, not its conversation: the session is the root chat."""
    parents = {r.request_id: r.parent_id for r in reqs if r.request_id is not None}
    if not any(parents.values()):
        return reqs

    def root(rid: str) -> str:
        seen = set()
        while (p := parents.get(rid)) is not None and p in parents and rid not in seen:
            seen.add(rid)
            rid = p
        return rid

    return [
        dataclasses.replace(r, session_id=root(r.request_id))
        if r.session_id is None and r.request_id is not None
        else r
        for r in reqs
    ]


def normalize(reqs: Iterable[TraceRequest]) -> list[TraceRequest]:
    """Sorted by arrival (stable), arrivals shifted so the first is at 0 s."""
    out = sorted(reqs, key=lambda r: r.arrival_s)
    if not out:
        return out
    t0 = out[0].arrival_s
    return [dataclasses.replace(r, arrival_s=r.arrival_s - t0) for r in out]


def read_trace(path: Path | str, fmt: str | None = None) -> list[TraceRequest]:
    """Every request of the trace at ``path``, sorted by arrival, the first at 0 s.

    Raises ``TraceError`` (with the file, line and reason) for anything unreadable."""
    path = Path(path)
    fmt = fmt or detect_format(path)
    if fmt not in _READERS:
        raise TraceError(f"{path}: unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    try:
        reqs = list(_READERS[fmt](path))
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not a text file ({e.reason})") from e
    except csv.Error as e:
        raise TraceError(f"{path}: bad CSV: {e}") from e
    if not reqs:
        raise TraceError(f"{path}: no requests in the trace")
    return normalize(_sessions(reqs))


def write_trace(path: Path | str, reqs: Iterable[TraceRequest]) -> None:
    """The ``meshserve`` JSONL format, which ``read_trace`` reads back unchanged."""
    with open(path, "w", encoding="utf-8") as f:
        for r in reqs:
            f.write(json.dumps(r.to_json()) + "\n")
