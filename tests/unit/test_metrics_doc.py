"""The README's metric table is the code's (``services/frontend/metrics_doc.py``), and every
frontend family it names is exposed by ``/metrics`` in a form Prometheus' parser reads; vLLM's
request families are there under the ``meshserve:`` prefix with ``model_name``."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from services.frontend.metrics_doc import families, rewrite

ROOT = Path(__file__).resolve().parents[2]
VLLM_FAMILIES = (
    "time_to_first_token_seconds",
    "request_time_per_output_token_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "prompt_tokens_total",
    "generation_tokens_total",
    "request_success_total",
)


def test_the_readme_table_is_current():
    text = (ROOT / "README.md").read_text()
    assert rewrite(text) == text, "run scripts/gen-docs"


def test_every_family_is_exposed_and_parses():
    import services.cluster_manager.service
    import services.frontend.service
    import services.job_executor.service
    import services.scaler.service  # noqa: F401  (every service's metrics, registered)

    documented = families()
    exposed = {f.name: f.type for f in text_string_to_metric_families(generate_latest().decode())}
    for name, kind, _, _, where in documented:
        if where == "node pool":
            continue  # its collector's, at its /metrics (tests/integration/test_service_metrics.py)
        assert exposed.get(name.removesuffix("_total") if kind == "counter" else name) == kind


def test_no_metric_is_defined_outside_the_documented_modules():
    import services.cluster_manager.service
    import services.frontend.service
    import services.job_executor.service
    import services.scaler.service  # noqa: F401

    registered = {m._name for m in REGISTRY._collector_to_names if isinstance(m, MetricWrapperBase)}
    documented = {name.removesuffix("_total") for name, kind, _, _, _ in families()}
    assert registered <= documented, registered - documented


def test_vllms_request_families_with_their_labels():
    by_name = {name: labels for name, _, labels, _, _ in families()}
    for family in VLLM_FAMILIES:
        labels = by_name[f"meshserve:{family}"]
        assert labels[:3] == ("model_name", "adapter", "tenant"), family


def test_the_scalers_targets_as_gauges():
    from services.scaler.metrics import observe_targets
    from services.scaler.target import Target

    t = Target(
        model="m-metrics",
        current=2,
        ready=1,
        wanted=3,
        stable_load=2.5,
        panic_load=3.0,
        backlog=1,
        slo_attainment=0.97,
        panicking=False,
        idle=False,
        reason="test",
    )
    observe_targets({"m-metrics": t})
    value = REGISTRY.get_sample_value
    assert value("meshserve:replicas", {"model_name": "m-metrics", "kind": "wanted"}) == 3
    assert value("meshserve:replicas", {"model_name": "m-metrics", "kind": "ready"}) == 1
    assert value("meshserve:scaler_load_instances", {"model_name": "m-metrics"}) == 2.5
    assert value("meshserve:scaler_slo_attainment", {"model_name": "m-metrics"}) == 0.97
