"""The Kubernetes manifests (``deploy/k8s``), validated offline since no cluster runs here:
each overlay rendered by ``kubectl kustomize`` (skipped, with the reason, where kubectl is
missing) and every object checked against the Kubernetes API's JSON schemas (strict: no
unknown field) with ``kubernetes-validate``; then what the design asks of them: every
service run once, the control plane's Deployments at two replicas behind a disruption
budget, probes on ``meshserve health``, resources, scrape annotations, each role's own
credentials only, auth never off, the node pools' host cache in memory and their device."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from services.cli import SERVICE_NAMES
from shared.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ("cpu", "gpu")
# kubectl's own version here, and the newest the validator knows.
VERSIONS = ("1.32.0", kubernetes_validate.latest_version())
CONTROL_PLANE = ("frontend", "job-executor", "cluster-manager", "scaler")


def _render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the overlays cannot be rendered (kustomize)")
    out = subprocess.run(
        [kubectl, "kustomize", str(ROOT / "deploy" / "k8s" / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def _by(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid_against_the_kubernetes_schemas(overlay: str) -> None:
    docs = _render(overlay)
    assert len(docs) >= 12
    for version in VERSIONS:
        for doc in docs:
            kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_workloads_are_what_the_design_asks(overlay: str) -> None:
    docs = _render(overlay)
    deployments, pdbs = _by(docs, "Deployment"), _by(docs, "PodDisruptionBudget")
    (pool,) = _by(docs, "DaemonSet").values()
    workloads = [*deployments.values(), pool]
    # Every service through a meshserve subcommand that exists, once.
    assert sorted(_container(w)["args"][0] for w in workloads) == sorted(SERVICE_NAMES)
    config = _by(docs, "ConfigMap")["meshserve-config"]["data"]
    assert config["MESHSERVE_AUTH"] != "off"
    # Settings the services accept (the *_FILE ones name the Secrets' mounts); Redis found
    # through its Sentinels.
    settings = Settings.load({k: v for k, v in config.items() if not k.endswith("_FILE")})
    assert settings.redis_sentinels and settings.redis_master == "mymaster"
    for name in CONTROL_PLANE:
        d = deployments[f"meshserve-{name}"]
        assert d["spec"]["replicas"] >= 2, name
        pdb = pdbs[f"meshserve-{name}"]["spec"]
        assert pdb["minAvailable"] == 1
        assert pdb["selector"]["matchLabels"] == d["spec"]["selector"]["matchLabels"]
    for w in workloads:
        name, c = w["metadata"]["name"], _container(w)
        assert c["livenessProbe"]["exec"]["command"] == ["meshserve", "health"], name
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        assert c["resources"]["limits"]["memory"], name
        annotations = w["spec"]["template"]["metadata"]["annotations"]
        port = int(annotations["prometheus.io/port"])
        assert annotations["prometheus.io/scrape"] == "true"
        assert port in {p["containerPort"] for p in c["ports"]}, name
        # Its own role's credentials, and no other's.
        role = SERVICE_NAMES[c["args"][0]].split(".")[-1].replace("_", "-")
        secrets = [
            v["secret"]["secretName"]
            for v in w["spec"]["template"]["spec"]["volumes"]
            if "secret" in v
        ]
        assert secrets == [f"meshserve-{role}"], name
        assert w["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"]
    frontend = _container(deployments["meshserve-frontend"])
    assert frontend["readinessProbe"]["exec"]["command"][:3] == ["meshserve", "health", "--url"]
    assert _env(frontend)["MESHSERVE_ADMIN_KEY_FILE"] == "/run/meshserve/admin-key"
    (service,) = _by(docs, "Service").values()
    assert (
        service["spec"]["selector"]
        == deployments["meshserve-frontend"]["spec"]["selector"]["matchLabels"]
    )
    # The node pool: its host cache in memory, under the volume's size limit; its device.
    spec = pool["spec"]["template"]["spec"]
    (shm,) = [v for v in spec["volumes"] if v["name"] == "host-cache"]
    assert shm["emptyDir"]["medium"] == "Memory"
    limit = _gib(shm["emptyDir"]["sizeLimit"])
    env = _env(_container(pool))
    assert 0 < int(env["MESHSERVE_HOST_CACHE_BYTES"]) < limit
    # Its weight server and KV server on the pod's address: other nodes fork and pull there.
    for name in ("MESHSERVE_HOST_CACHE_SERVE_HOST", "MESHSERVE_KV_HOST"):
        assert env[name] == {"fieldRef": {"fieldPath": "status.podIP"}}, name
    assert spec["nodeSelector"] == {"meshserve.io/node-pool": overlay}
    if overlay == "gpu":
        assert _container(pool)["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert _container(pool)["image"] == "meshserve:gpu"
        assert env["MESHSERVE_ENGINE"] == "vllm" and env["MESHSERVE_DEVICE"] == "cuda"
        assert all(_container(d)["image"] == "meshserve:latest" for d in deployments.values())
    else:
        assert "nvidia.com/gpu" not in _container(pool)["resources"].get("limits", {})
        assert env["MESHSERVE_DEVICE"] == "cpu"


def _gib(quantity: str) -> int:
    assert quantity.endswith("Gi"), quantity
    return int(quantity[:-2]) * 1024**3
