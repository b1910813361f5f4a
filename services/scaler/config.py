"""The scaler's policy configuration from the settings: built once, here, for the scaler
service and for ``meshserve-loadgen simulate`` (``SimConfig.settings``) alike."""

from __future__ import annotations

from services.scaler.state import ModelPolicy, ScalerConfig
from shared.settings import Settings


def scaler_config(settings: Settings) -> ScalerConfig:
    s = settings.scaler
    default = ModelPolicy(
        min_replicas=s.min_replicas,
        max_replicas=s.max_replicas,
        target_utilization=s.target_utilization,
        keep_alive_s=s.keep_alive.total_seconds(),
        max_prefill_replicas=s.max_prefill_replicas,
    )
    models = {
        name: ModelPolicy(
            min_replicas=m.min_replicas if m.min_replicas is not None else default.min_replicas,
            max_replicas=m.max_replicas if m.max_replicas is not None else default.max_replicas,
            target_utilization=m.target_utilization or default.target_utilization,
            keep_alive_s=m.keep_alive.total_seconds()
            if m.keep_alive is not None
            else default.keep_alive_s,
            max_prefill_replicas=m.max_prefill_replicas
            if m.max_prefill_replicas is not None
            else default.max_prefill_replicas,
        )
        for name, m in s.model_scaling.items()
    }
    return ScalerConfig(
        default=default,
        models=models,
        stable_window_s=s.stable_window.total_seconds(),
        panic_window_s=s.panic_window.total_seconds(),
        slo_target=s.slo_target,
        load_bandwidth=settings.host_cache.load_bandwidth,
        preload_window_s=s.preload_window.total_seconds(),
        slo=s.slo(),
    )
