"""What a job executor tells the scaler of each model's jobs (``TrafficReport``): arrivals,
their prompt and output tokens and the misses since the last report, and the jobs it holds
now. Pure bookkeeping, kept by the job executor service and by ``meshserve-loadgen
simulate``'s job executor alike."""

from __future__ import annotations

import math

from shared.messages.scaling import ModelTraffic


class TrafficLedger:
    """Counts per model, since the last ``report``; the held jobs are a gauge that stays."""

    def __init__(self) -> None:
        self._models: dict[str, ModelTraffic] = {}

    def _of(self, model: str) -> ModelTraffic:
        t = self._models.get(model)
        if t is None:
            t = self._models[model] = ModelTraffic(model=model)
        return t

    def arrived(self, model: str, prompt_tokens: int, max_output_tokens: int) -> None:
        t = self._of(model)
        t.arrivals += 1
        t.prompt_tokens += prompt_tokens
        t.max_output_tokens += max_output_tokens

    def prefill_wanted(self, model: str, uncached_tokens: int) -> None:
        """A job placed whose prompt the PD rule would prefill on a prefill instance
        (``PdDecision.wanted``), with the prompt tokens it would compute there."""
        t = self._of(model)
        t.pd_arrivals += 1
        t.pd_prompt_tokens += uncached_tokens

    def prefill_placed(self, model: str, uncached_tokens: int) -> None:
        """A job's prompt went to a prefill instance (its decode task placed against it),
        ``uncached_tokens`` computed there."""
        self._of(model).pd_placed_tokens += uncached_tokens

    def held(self, model: str, prompt_tokens: int) -> None:
        """A job waits for an instance of ``model`` (none can take it now)."""
        t = self._of(model)
        t.held += 1
        t.held_prompt_tokens += prompt_tokens

    def released(self, model: str, prompt_tokens: int) -> None:
        """A held job was placed, failed or given up."""
        t = self._of(model)
        t.held -= 1
        t.held_prompt_tokens -= prompt_tokens

    def missed(self, model: str) -> None:
        """A job failed for want of an instance (its placement deadline passed)."""
        self._of(model).misses += 1

    def __bool__(self) -> bool:
        return bool(self._models)

    def report(self) -> list[ModelTraffic]:
        """Every model with something to say, and a new period: arrivals and misses start
        again from zero, held jobs stay counted."""
        models = list(self._models.values())
        self._models = {
            m.model: ModelTraffic(
                model=m.model, held=m.held, held_prompt_tokens=m.held_prompt_tokens
            )
            for m in models
            if m.held
        }
        return models


class RateMeter:
    """Each model's recent arrival rate (requests/s), an exponentially weighted mean over
    ``horizon_s``: what PD's heat map is indexed by (with the model's instances)."""

    def __init__(self, horizon_s: float = 30.0) -> None:
        self.horizon_s = horizon_s
        self._models: dict[str, tuple[float, float]] = {}  # model -> (rate, at)

    def _decayed(self, model: str, now: float) -> float:
        rate, at = self._models.get(model, (0.0, now))
        return rate * math.exp(-max(now - at, 0.0) / self.horizon_s)

    def arrived(self, model: str, now: float) -> None:
        self._models[model] = (self._decayed(model, now) + 1.0 / self.horizon_s, now)

    def rate(self, model: str, now: float) -> float:
        return self._decayed(model, now)
