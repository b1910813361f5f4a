"""Service-level objectives, pure arithmetic.

The default is LLM-Mesh's: a request meets its SLO when its time to first token is at most
``max(2 s, input_tokens / 512 s)`` (a long prompt may take longer to prefill) and its time
per output token is at most 0.25 s. A failed request misses, whatever its timings; a
request with one output token has no TPOT and is judged on TTFT alone.
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class SLO:
    ttft_s: float = 2.0
    ttft_per_input_token_s: float = 1 / 512
    tpot_s: float = 0.25

    def ttft_limit_s(self, input_tokens: int) -> float:
        return max(self.ttft_s, input_tokens * self.ttft_per_input_token_s)

    def met(
        self, *, ok: bool, input_tokens: int, ttft_s: float | None, tpot_s: float | None
    ) -> bool:
        if not ok or ttft_s is None:
            return False
        if ttft_s > self.ttft_limit_s(input_tokens):
            return False
        return tpot_s is None or tpot_s <= self.tpot_s

    def describe(self) -> str:
        per = self.ttft_per_input_token_s
        scale = f"input_tokens/{1 / per:g} s" if per > 0 else "0"
        return f"TTFT <= max({self.ttft_s:g} s, {scale}), TPOT <= {self.tpot_s:g} s"

    def to_json(self) -> dict[str, float]:
        return dataclasses.asdict(self)


_SPEC = re.compile(r"^\s*(ttft|ttft_per_token|tpot)\s*=\s*([0-9.eE+-]+)\s*(ms|s)?\s*$")


def parse_slo(spec: str, base: SLO | None = None) -> SLO:
    """``"ttft=2s,ttft_per_token=1/512,tpot=250ms"`` (any subset) over ``base``.
    ``ttft_per_token`` is seconds per input token and may be written ``1/N``."""
    out = base or SLO()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if m := re.match(r"^\s*ttft_per_token\s*=\s*1\s*/\s*([0-9.]+)\s*$", part):
            out = dataclasses.replace(out, ttft_per_input_token_s=1 / float(m.group(1)))
            continue
        m = _SPEC.match(part)
        if not m:
            raise ValueError(
                f"bad SLO term {part!r} (want ttft=2s, ttft_per_token=1/512, tpot=250ms)"
            )
        key, value, unit = m.group(1), float(m.group(2)), m.group(3) or "s"
        value = value / 1000 if unit == "ms" else value
        field = {"ttft": "ttft_s", "ttft_per_token": "ttft_per_input_token_s", "tpot": "tpot_s"}[
            key
        ]
        out = dataclasses.replace(out, **{field: value})
    return out


def attainment(met: list[bool]) -> float | None:
    """The fraction of requests that met the SLO (``None`` for no requests)."""
    return sum(met) / len(met) if met else None


def goodput_rps(met: list[bool], duration_s: float) -> float:
    """Requests that met the SLO per second of the run."""
    return sum(met) / duration_s if duration_s > 0 else 0.0
