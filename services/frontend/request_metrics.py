"""Each request's metrics in vLLM's families (its ``docs/design/metrics.md``), with the
``meshserve:`` prefix in place of ``vllm:`` and the same suffixes, units, buckets and
``model_name`` label, so a dashboard built for vLLM works by changing the prefix. Labels vLLM
lacks: ``adapter`` (a fine-tuned model's own name; ``model_name`` is its base model, the one
whose instances ran it) and ``tenant``.

The frontend sees each request from its arrival to its last token, so it measures them all
here, whichever engine ran the request; the phases are the request's own: queued (submitted
until a TE took it, holding for capacity included), prefill (taken until its first token
came back), decode (first token to last)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Counter, Histogram

LABELS = ["model_name", "adapter", "tenant"]
# vLLM's buckets for each family (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


def _histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
    return Histogram(f"meshserve:{name}", doc, LABELS, buckets=buckets)


TIME_TO_FIRST_TOKEN = _histogram(
    "time_to_first_token_seconds",
    "Time to first token (submitted to the first token)",
    TTFT_BUCKETS,
)
INTER_TOKEN_LATENCY = _histogram(
    "inter_token_latency_seconds",
    "Time between a request's successive tokens as the frontend received them (tokens that "
    "came together share their gap)",
    TPOT_BUCKETS,
)
TIME_PER_OUTPUT_TOKEN = _histogram(
    "request_time_per_output_token_seconds",
    "Each request's mean time per output token after its first",
    TPOT_BUCKETS,
)
E2E_LATENCY = _histogram(
    "e2e_request_latency_seconds", "Request latency, submitted to its last token", REQUEST_BUCKETS
)
QUEUE_TIME = _histogram(
    "request_queue_time_seconds",
    "Time a request waited before a TE took it (holding for capacity included)",
    REQUEST_BUCKETS,
)
PREFILL_TIME = _histogram(
    "request_prefill_time_seconds",
    "Time from a TE taking a request to its first token",
    REQUEST_BUCKETS,
)
DECODE_TIME = _histogram(
    "request_decode_time_seconds", "Time from a request's first token to its last", REQUEST_BUCKETS
)
PROMPT_TOKENS_PER_REQUEST = _histogram(
    "request_prompt_tokens", "Prompt tokens of each finished request", TOKEN_BUCKETS
)
GENERATION_TOKENS_PER_REQUEST = _histogram(
    "request_generation_tokens", "Tokens generated for each finished request", TOKEN_BUCKETS
)
PROMPT_TOKENS = Counter("meshserve:prompt_tokens", "Prompt tokens of finished requests", LABELS)
GENERATION_TOKENS = Counter("meshserve:generation_tokens", "Tokens generated", LABELS)
REQUEST_SUCCESS = Counter(
    "meshserve:request_success",
    "Requests that ended, by finished_reason: stop, length, or abort (failed, cancelled, or "
    "the client went away)",
    [*LABELS, "finished_reason"],
)


def observe(
    *,
    model_name: str,
    adapter: str,
    tenant: str,
    prompt_tokens: int,
    output_tokens: int,
    finish_reason: str | None,
    submitted: float,
    accepted: float | None,
    first_token: float | None,
    last_token: float | None,
    ended: float,
    token_gaps: Iterable[tuple[float, int]] = (),
) -> None:
    """One request that ended; times are ``time.monotonic()`` readings (None: never
    reached); ``token_gaps``: (seconds since the tokens before, how many came) for each
    arrival of tokens after the first token, those that came with it at a gap of 0, so the
    inter-token latencies number the output tokens less one."""
    labels = (model_name, adapter, tenant)
    PROMPT_TOKENS.labels(*labels).inc(prompt_tokens)
    GENERATION_TOKENS.labels(*labels).inc(output_tokens)
    REQUEST_SUCCESS.labels(*labels, finish_reason or "abort").inc()
    E2E_LATENCY.labels(*labels).observe(ended - submitted)
    if accepted is not None:
        QUEUE_TIME.labels(*labels).observe(accepted - submitted)
    if first_token is not None:
        TIME_TO_FIRST_TOKEN.labels(*labels).observe(first_token - submitted)
        if accepted is not None:
            PREFILL_TIME.labels(*labels).observe(first_token - accepted)
        if last_token is not None:
            DECODE_TIME.labels(*labels).observe(last_token - first_token)
            if output_tokens > 1:
                TIME_PER_OUTPUT_TOKEN.labels(*labels).observe(
                    (last_token - first_token) / (output_tokens - 1)
                )
    itl = INTER_TOKEN_LATENCY.labels(*labels)
    for gap, n in token_gaps:
        for _ in range(n):
            itl.observe(gap / n)
    if finish_reason is not None:
        PROMPT_TOKENS_PER_REQUEST.labels(*labels).observe(prompt_tokens)
        GENERATION_TOKENS_PER_REQUEST.labels(*labels).observe(output_tokens)
