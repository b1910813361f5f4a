"""What clients saw, per model, for the scaler: requests finished, how many met the SLO,
tokens produced. Counted as requests end; taken (and reset) by each report."""

from __future__ import annotations

from shared.messages.scaling import ModelOutcomes
from shared.slo import SLO


class Outcomes:
    def __init__(self, slo: SLO) -> None:
        self.slo = slo
        self._by_model: dict[str, ModelOutcomes] = {}

    def record(
        self,
        model: str,
        *,
        ok: bool,
        prompt_tokens: int,
        output_tokens: int,
        ttft_s: float | None,
        tpot_s: float | None,
    ) -> bool:
        """Count one finished request; whether it met the SLO."""
        met = self.slo.met(ok=ok, input_tokens=prompt_tokens, ttft_s=ttft_s, tpot_s=tpot_s)
        o = self._by_model.get(model)
        if o is None:
            o = self._by_model[model] = ModelOutcomes(model=model)
        o.finished += 1
        o.slo_met += met
        o.output_tokens += output_tokens
        return met

    def take(self) -> list[ModelOutcomes]:
        out, self._by_model = list(self._by_model.values()), {}
        return out
