"""How many tokens a request will produce, predicted in 128-token buckets from the requests
of its model that finished before it (DeepServe's decode-length predictor, §4.5): PD's
`auto` weighs a long prompt with a short output differently from one with a long output
(disaggregation pays for the first, where the prefill would stall many decode iterations for
little decoding).

The predictor keeps, per model and per prompt-length class (powers of two), how often each
output bucket occurred, with exponential forgetting (``decay`` per learned request) so that
it follows a workload that changes; it predicts the most frequent bucket of the prompt's
class, else of the model, else nothing. Its prediction never exceeds the request's own
``max_tokens``. Pure state, no I/O: the job executor and ``meshserve-loadgen simulate`` use
the same class. ``python -m bench.output_length`` reports its accuracy on the shipped traces
(README, Prefill/decode disaggregation)."""

from __future__ import annotations

import dataclasses

BUCKET_TOKENS = 128


def bucket_of(tokens: int, bucket: int = BUCKET_TOKENS) -> int:
    """The bucket of an output length: 0 for 1..128 tokens, 1 for 129..256, ..."""
    return max(tokens - 1, 0) // bucket


def prompt_class(prompt_tokens: int) -> int:
    """Prompts by powers of two: 0 for 1 token, 1 for 2-3, ..., 12 for 4096-8191."""
    return max(prompt_tokens, 1).bit_length() - 1


@dataclasses.dataclass(slots=True)
class _Counts:
    weights: dict[int, float] = dataclasses.field(default_factory=dict)  # bucket -> weight
    scale: float = 1.0  # weights are stored divided by this (lazy decay)

    def add(self, bucket: int, decay: float) -> None:
        self.scale /= decay
        if self.scale > 1e12:  # renormalise before floats lose precision
            self.weights = {b: w / self.scale for b, w in self.weights.items()}
            self.scale = 1.0
        self.weights[bucket] = self.weights.get(bucket, 0.0) + self.scale

    def mode(self) -> int | None:
        if not self.weights:
            return None
        return max(self.weights.items(), key=lambda kv: (kv[1], -kv[0]))[0]


@dataclasses.dataclass(slots=True)
class OutputPredictor:
    bucket: int = BUCKET_TOKENS
    decay: float = 0.999  # a learned request's weight after 1,000 more: 0.37
    _by_class: dict[tuple[str, int], _Counts] = dataclasses.field(default_factory=dict)
    _by_model: dict[str, _Counts] = dataclasses.field(default_factory=dict)
    # Placed and not ended: key -> (model, prompt tokens), oldest first, at most max_pending
    # (a task whose end never comes, its TE lost, is forgotten in time).
    max_pending: int = 65536
    _pending: dict[str, tuple[str, int]] = dataclasses.field(default_factory=dict)

    def placed(self, key: str, model: str, prompt_tokens: int) -> None:
        """A task was placed: learn from it when it ends (``ended``)."""
        self._pending[key] = (model, prompt_tokens)
        while len(self._pending) > self.max_pending:
            del self._pending[next(iter(self._pending))]

    def ended(self, key: str, output_tokens: int | None) -> None:
        """A placed task ended: finished with ``output_tokens`` (learned), or not (None)."""
        placed = self._pending.pop(key, None)
        if placed is not None and output_tokens is not None:
            self.learn(*placed, output_tokens)

    def learn(self, model: str, prompt_tokens: int, output_tokens: int) -> None:
        """A request of ``model`` finished with ``output_tokens`` tokens."""
        b = bucket_of(output_tokens, self.bucket)
        key = (model, prompt_class(prompt_tokens))
        self._by_class.setdefault(key, _Counts()).add(b, self.decay)
        self._by_model.setdefault(model, _Counts()).add(b, self.decay)

    def predict_bucket(self, model: str, prompt_tokens: int) -> int | None:
        """The most likely output bucket; None before the model's first finished request."""
        counts = self._by_class.get((model, prompt_class(prompt_tokens)))
        if counts is not None and (b := counts.mode()) is not None:
            return b
        counts = self._by_model.get(model)
        return counts.mode() if counts is not None else None

    def predict(self, model: str, prompt_tokens: int, max_tokens: int) -> int:
        """Predicted output tokens (the bucket's upper bound), at most ``max_tokens``;
        ``max_tokens`` itself before anything was learned."""
        b = self.predict_bucket(model, prompt_tokens)
        if b is None:
            return max_tokens
        return min((b + 1) * self.bucket, max_tokens)
