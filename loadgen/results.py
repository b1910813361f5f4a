"""One replayed request's outcome: one line of ``requests.jsonl``.

Times are seconds from the start of the replay (``scheduled_s`` when the trace said to send
it, ``sent_s`` when it went out) or durations in seconds. Token counts come from the
server's usage where it reports them, else from the stream."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


@dataclasses.dataclass
class Result:
    index: int
    model: str
    scheduled_s: float
    sent_s: float = 0.0
    input_tokens: int = 0  # prompt tokens sent (after clipping), as synthesised
    output_tokens: int = 0  # max_tokens asked for (after clipping)
    trace_input_tokens: int = 0
    trace_output_tokens: int = 0
    clipped_prompt: bool = False
    clipped_output: bool = False
    prompt_tokens: int = 0  # as the server counted them
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    gaps_s: list[float] = dataclasses.field(default_factory=list)
    status: int = 0
    error: str | None = None
    trace_model: str | None = None
    session_id: str | None = None
    disaggregated: bool | None = None  # how the server placed it, where it says (PD)

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200 and self.e2e_s is not None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (``None`` below two tokens)."""
        if not self.ok or self.e2e_s is None or self.ttft_s is None:
            return None
        if self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    @property
    def lag_s(self) -> float:
        """How late the request went out against the trace's schedule."""
        return self.sent_s - self.scheduled_s

    @property
    def slo_input_tokens(self) -> int:
        """The prompt length the TTFT allowance scales with: the server's count if known."""
        return self.prompt_tokens or self.input_tokens

    def token_times_s(self) -> list[float]:
        """When each streamed token arrived, in seconds from the start of the replay."""
        if self.ttft_s is None:
            return []
        t = self.sent_s + self.ttft_s
        out = [t]
        for g in self.gaps_s:
            t += g
            out.append(t)
        return out

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["tpot_s"] = self.tpot_s
        for k in ("sent_s", "scheduled_s", "ttft_s", "e2e_s", "tpot_s"):
            if d[k] is not None:
                d[k] = round(d[k], 6)
        d["gaps_s"] = [round(g, 6) for g in self.gaps_s]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Result:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def write_results(path: Path, results: Iterable[Result]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in results:
            f.write(json.dumps(r.to_json()) + "\n")


def read_results(path: Path) -> list[Result]:
    with open(path, encoding="utf-8") as f:
        return [Result.from_json(json.loads(line)) for line in f if line.strip()]
