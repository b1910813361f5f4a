"""From trace requests to what will be sent: the served model, and lengths that fit.

Pure: the same trace and options give the same plan, which ``replay`` then sends at the
planned times."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from loadgen.traces import TraceRequest


class PlanError(ValueError):
    pass


@dataclasses.dataclass(frozen=True, slots=True)
class Planned:
    index: int
    arrival_s: float
    model: str
    input_tokens: int
    output_tokens: int
    trace_input_tokens: int
    trace_output_tokens: int
    clipped_prompt: bool = False
    clipped_output: bool = False
    hash_ids: tuple[int, ...] = ()
    block_size: int = 0
    trace_model: str | None = None
    session_id: str | None = None

    @property
    def key(self) -> str:
        """Names the request's unique (unshared) prompt tokens."""
        return str(self.index)


def parse_models_map(spec: str | None) -> dict[str, str]:
    """``"ChatGPT=demo,GPT-4=demo2"`` → ``{"ChatGPT": "demo", "GPT-4": "demo2"}``; the key
    ``*`` matches every trace model not named."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in (spec or "").split(","))):
        src, sep, dst = part.partition("=")
        if not sep or not src.strip() or not dst.strip():
            raise PlanError(f"bad --models-map entry {part!r} (want TRACE_MODEL=SERVED_MODEL)")
        out[src.strip()] = dst.strip()
    return out


def served_model(trace_model: str | None, model: str | None, models_map: Mapping[str, str]) -> str:
    """``--models-map`` first (exact name, then ``*``), then ``--model``, then the trace's
    own name."""
    if trace_model is not None and trace_model in models_map:
        return models_map[trace_model]
    if "*" in models_map:
        return models_map["*"]
    if model:
        return model
    if trace_model:
        return trace_model
    raise PlanError("the trace names no model: give --model (or --models-map '*=MODEL')")


def fit(
    input_tokens: int,
    output_tokens: int,
    *,
    max_context: int | None,
    max_output_tokens: int | None = None,
) -> tuple[int, int, bool, bool]:
    """Lengths that a model of ``max_context`` tokens accepts: a prompt of at least one
    token and at most ``max_context - 1`` (the tail is cut, so a shared prefix survives),
    an output of at least one token, at most ``max_output_tokens`` and at most what is left
    of the context. Returns ``(input, output, prompt_clipped, output_clipped)``; output
    clipping counts any cut, the cap's included."""
    inp = max(1, input_tokens)
    out = max(1, output_tokens)
    clipped_prompt = False
    if max_context is not None:
        if max_context < 2:
            raise PlanError(f"a context of {max_context} tokens leaves no room to generate")
        if inp > max_context - 1:
            inp, clipped_prompt = max_context - 1, True
    if max_output_tokens is not None:
        out = min(out, max_output_tokens)
    if max_context is not None:
        out = min(out, max_context - inp)
    return inp, out, clipped_prompt, out < output_tokens


def plan(
    reqs: Sequence[TraceRequest],
    *,
    model: str | None = None,
    models_map: Mapping[str, str] | None = None,
    max_context: Mapping[str, int | None] | None = None,
    max_output_tokens: int | None = None,
) -> list[Planned]:
    """One ``Planned`` per trace request, in arrival order. ``max_context`` maps served
    model names to their context length (missing or ``None``: no limit known)."""
    models_map = models_map or {}
    max_context = max_context or {}
    out = []
    for i, r in enumerate(reqs):
        m = served_model(r.model, model, models_map)
        inp, outp, cp, co = fit(
            r.input_tokens,
            r.output_tokens,
            max_context=max_context.get(m),
            max_output_tokens=max_output_tokens,
        )
        out.append(
            Planned(
                index=i,
                arrival_s=r.arrival_s,
                model=m,
                input_tokens=inp,
                output_tokens=outp,
                trace_input_tokens=r.input_tokens,
                trace_output_tokens=r.output_tokens,
                clipped_prompt=cp,
                clipped_output=co,
                hash_ids=r.hash_ids,
                block_size=r.block_size,
                trace_model=r.model,
                session_id=r.session_id,
            )
        )
    return out
