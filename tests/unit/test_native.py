"""shared/native.py: processes that need one library at once compile it once."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import stat
from pathlib import Path

from shared.native import Toolchain, build


def _build(source: str, cc: str, cache: str) -> str:
    return str(
        build(
            "probe",
            [Path(source)],
            Toolchain(cc=cc, cache_dir=Path(cache)),
            [(["-shared", "-fPIC"], [])],
        )
    )


def test_processes_building_at_once_run_one_compiler(tmp_path: Path) -> None:
    source = tmp_path / "probe.c"
    source.write_text("int probe(void) { return 42; }\n")
    calls = tmp_path / "calls"
    cc = tmp_path / "slow-cc"
    # A compiler slow enough that every process reaches the build while the first compiles.
    cc.write_text(
        "#!/bin/sh\n"
        f'case "$1" in --version) exec cc --version;; esac\n'
        f'echo x >> {calls}\nsleep 1\nexec cc "$@"\n'
    )
    cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(3, mp_context=ctx) as pool:
        args = (str(source), str(cc), str(tmp_path / "k"))
        paths = list(pool.map(_build, *([a] * 3 for a in args)))
    assert len(set(paths)) == 1 and os.path.exists(paths[0])
    assert calls.read_text().count("x") == 1  # the others waited and loaded its library
