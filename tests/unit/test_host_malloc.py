"""host_malloc: a large tensor freed and made again comes from the heap, not fresh pages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The probe imports the engine first, as a TE does before any forward. In a process that has
# imported torch alone, 64 MiB tensors page-fault in full each time even with the thresholds
# set (the heap's top cannot grow in place there, and glibc falls back to mmap).
PROBE = """
import resource, sys, torch
import services.task_executor.engines.torch_engine.engine
from services.task_executor.engines.torch_engine.host_malloc import keep_large_allocations
if sys.argv[1] == "on":
    assert keep_large_allocations()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(2):  # 64 MiB of float32, made and freed: the heap grows to hold it
    torch.ones(64 << 18)
each = []
for _ in range(5):  # the fewest faults of one more: a stray regrowth of the heap is no verdict
    before = faults()
    torch.ones(64 << 18)
    each.append(faults() - before)
print(min(each))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_large_tensors_stop_page_faulting_once_the_thresholds_are_set() -> None:
    def faults(mode: str) -> int:
        # 4 KiB pages, so that a fault is a page (torch's huge pages would fault per 2 MiB).
        env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "0"}
        out = subprocess.run(
            [sys.executable, "-c", PROBE, mode],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            env=env,
        )
        return int(out.stdout.strip().splitlines()[-1])

    pages = (64 << 20) // 4096
    assert faults("off") > pages // 2  # glibc maps and unmaps each one: a fault per page
    assert faults("on") < pages // 20
