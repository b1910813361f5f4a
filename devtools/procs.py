"""The processes of a local cluster, found the way `meshserve up` starts them: each runs
`python -m services.<name>` (a TE: `services.task_executor.worker`) with
MESHSERVE_CLUSTER=<cluster> in its environment. For the tests and benches that kill them or
read their memory."""

from __future__ import annotations

import os
from pathlib import Path


def processes_of(cluster: str) -> list[int]:
    """Pids of live processes started with MESHSERVE_CLUSTER=<cluster>."""
    needle = f"MESHSERVE_CLUSTER={cluster}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle in (d / "environ").read_bytes().split(b"\0"):
                stat = (d / "stat").read_text()
                if stat.rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(d.name))
        except OSError:
            continue
    return pids


def module_of(pid: int) -> str | None:
    """The module a `python -m` process runs, or None."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    if b"-m" not in argv:
        return None
    i = argv.index(b"-m")
    return argv[i + 1].decode() if i + 1 < len(argv) else None


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
