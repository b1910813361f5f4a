"""The multi-host tests' fixtures: three network-namespace hosts and a cluster spread over
them (``devtools.multihost.MultiHostCluster``), one per module. Skipped, with the reason, where network
namespaces cannot be built (not root, no iproute2)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devtools.multihost import MultiHostCluster
from devtools.netns_hosts import Hosts, available


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    if why := available():
        pytest.skip(f"multi-host tests: {why}")
    h = Hosts(3, tmp_path_factory.mktemp("hosts"))
    try:
        yield h.up()
    finally:
        h.down()


@pytest.fixture(scope="module")
def mh_models_dir(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Path:
    d = tmp_path_factory.mktemp("mh-models")
    (d / "demo").symlink_to(demo_model_dir)
    (d / "demo2").symlink_to(demo_model_dir)  # another model, the same weights
    return d


def start_cluster(hosts: Hosts, models_dir: Path, **settings: str) -> MultiHostCluster:
    return MultiHostCluster(hosts, models_dir, **settings).start()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    """A failed test's report carries its cluster's story: the services' warnings and errors
    while it ran and their last lines (the module's cluster serves the next tests too, whose
    failures would otherwise show only their own moment)."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when != "call" or not report.failed:
        return
    for value in getattr(item, "funcargs", {}).values():
        if isinstance(value, MultiHostCluster):
            report.sections.append(("cluster logs", value.failure_report(since=call.start)))
