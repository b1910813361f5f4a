"""Hugging Face checkpoint → the OpenVINO IR that OpenVINOEngine serves.

The IR lives next to the checkpoint, in ``<model_dir>/openvino/<weight_format>/``: the model
(``openvino_model.xml``/``.bin``, stateful, which GenAI turns into paged attention at load
time), the OpenVINO tokenizer and detokenizer, and the configs GenAI reads (the EOS ids come
from its ``generation_config.json``). It is made once, by optimum-intel's exporter, and
appears atomically: the export writes into a temporary sibling that is renamed into place,
under a file lock, so TEs that start on one model together convert it once and never load a
half-written IR.

optimum-intel pins an older transformers than the project's (2.2.0 wants ``<5.6``, and does
not import under 5.2x), so the export runs in a separate virtual environment,
``.venv-ov-export`` at the repository root, created on first use with exactly the versions
below. The export only needs the checkpoint and the exporter; the engine itself needs only
``openvino``, ``openvino-genai`` and ``openvino-tokenizers``.

CLI: ``scripts/convert-openvino MODEL_DIR [--weight-format int8|fp16|fp32|int4] [--force]``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from shared.settings import Settings, process_environment

# The formats optimum-intel's exporter offers that the CPU plugin runs well; bf16 is not one
# of them (bf16 is an inference precision of the plugin, not a storage format of the IR).
WEIGHT_FORMATS = ("int8", "fp16", "fp32", "int4")
IR_MODEL_FILES = ("openvino_model.xml", "openvino_model.bin")
STAMP = "meshserve-openvino.json"

REPO_ROOT = Path(__file__).resolve().parents[4]

# Known to export Llama- and Qwen2-family checkpoints together. openvino and
# openvino-tokenizers follow the runtime's versions instead (see export_requirements): an IR
# and tokenizer made by another release may use ops the runtime does not know.
EXPORT_PINS = (
    "torch==2.13.0",
    "transformers==5.5.4",
    "optimum==2.3.0",
    "optimum-intel==2.2.0",
    "nncf==3.4.0",
)
DEFAULT_OPENVINO = "2026.4.1"
DEFAULT_OPENVINO_TOKENIZERS = "2026.4.1.0"


class ConversionError(RuntimeError):
    pass


def ir_dir(model_dir: Path | str, weight_format: str) -> Path:
    return Path(model_dir) / "openvino" / weight_format


def is_complete(path: Path) -> bool:
    return all((path / f).is_file() for f in IR_MODEL_FILES)


def ensure_ir(
    model_dir: Path | str,
    weight_format: str = "int8",
    *,
    out_dir: Path | str | None = None,
    python: Path | str | None = None,
    export_venv: Path | str | None = None,
    force: bool = False,
    quiet: bool = True,
) -> Path:
    """The IR directory for ``model_dir`` in ``weight_format``, exported first if missing.

    ``out_dir`` puts it elsewhere (a read-only model cache); ``python`` is an interpreter
    that has optimum-intel (default: this one if it has it, else the export venv, built at
    ``export_venv`` on first use; settings: MESHSERVE_OV_EXPORT_PYTHON and _VENV)."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, not {weight_format!r}")
    model_dir = Path(model_dir).resolve()
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} holds no Hugging Face checkpoint (no config.json)")
    target = Path(out_dir).resolve() if out_dir else ir_dir(model_dir, weight_format)
    if is_complete(target) and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock"):
        if is_complete(target) and not force:
            return target  # another process converted it while we waited
        exporter = Path(python) if python else export_python(export_venv, quiet=quiet)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            # mkdtemp makes it private; the IR is shared by every TE user on the host.
            tmp.chmod(0o755)
            started = time.monotonic()
            _export(exporter, model_dir, weight_format, tmp, quiet=quiet)
            if not is_complete(tmp):
                raise ConversionError(f"the exporter wrote no {' and '.join(IR_MODEL_FILES)}")
            (tmp / STAMP).write_text(
                json.dumps(
                    {
                        "source": str(model_dir),
                        "weight_format": weight_format,
                        "export_seconds": round(time.monotonic() - started, 1),
                        "exporter": str(exporter),
                    },
                    indent=2,
                )
            )
            if target.exists():  # only with force, or a leftover without a complete IR
                shutil.rmtree(target)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _export(python: Path, model_dir: Path, weight_format: str, out: Path, *, quiet: bool) -> None:
    cmd = [
        str(python),
        "-m",
        "optimum.commands.optimum_cli",
        "export",
        "openvino",
        "--model",
        str(model_dir),
        "--task",
        "text-generation-with-past",
        "--weight-format",
        weight_format,
        str(out),
    ]
    # The checkpoint is local: without these the exporter still asks the Hub about it.
    env = process_environment({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    _run(cmd, env=env, quiet=quiet, what=f"exporting {model_dir} to OpenVINO {weight_format}")


# --- the exporter's interpreter ------------------------------------------------------------


def export_python(venv: Path | str | None = None, *, quiet: bool = True) -> Path:
    """An interpreter with optimum-intel: this one if it has the exporter, else the export
    venv (at ``venv``, or the default; created on first use)."""
    if importlib.util.find_spec("optimum") and importlib.util.find_spec("optimum.intel"):
        return Path(sys.executable)
    return ensure_export_venv(Path(venv) if venv else None, quiet=quiet)


def default_export_venv() -> Path:
    if (REPO_ROOT / "pyproject.toml").is_file() and os.access(REPO_ROOT, os.W_OK):
        return REPO_ROOT / ".venv-ov-export"
    return Path.home() / ".cache" / "meshserve" / "venv-ov-export"


def export_requirements() -> list[str]:
    def runtime(dist: str, default: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return default

    return [
        *EXPORT_PINS,
        f"openvino=={runtime('openvino', DEFAULT_OPENVINO)}",
        f"openvino-tokenizers=={runtime('openvino-tokenizers', DEFAULT_OPENVINO_TOKENIZERS)}",
    ]


def ensure_export_venv(venv: Path | None = None, *, quiet: bool = True) -> Path:
    """The export venv's interpreter; (re)built when missing or made for other versions."""
    venv = (venv or default_export_venv()).absolute()
    python = venv / "bin" / "python"
    reqs = export_requirements()
    stamp = venv / ".meshserve-ov-export"
    wanted = "\n".join(reqs) + "\n"

    def ready() -> bool:
        return python.is_file() and stamp.is_file() and stamp.read_text() == wanted

    if ready():
        return python
    venv.parent.mkdir(parents=True, exist_ok=True)
    # The lock lives outside the venv (which is deleted and rebuilt under it) and outside the
    # repository (where it would be one more untracked file).
    key = hashlib.sha256(str(venv).encode()).hexdigest()[:16]
    with _locked(Path(tempfile.gettempdir()) / f"meshserve-ov-export-{key}.lock"):
        if ready():
            return python
        # A venv cannot be moved once made (its scripts name its path), so it is built in
        # place and only the stamp, written last, says it is whole.
        if venv.exists():
            shutil.rmtree(venv)
        what = f"creating the OpenVINO export environment {venv} (once; about a minute)"
        print(f"meshserve: {what}", file=sys.stderr, flush=True)
        _run([sys.executable, "-m", "venv", str(venv)], quiet=quiet, what=what)
        constraints = venv / "constraints.txt"
        # optimum-intel requires torchvision unpinned, which would pull another torch.
        constraints.write_text("torch==2.13.0\n")
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        _run([*pip, "-c", str(constraints), *reqs], quiet=quiet, what=what)
        # Only the import-time requirement check needs torchvision, and the exporter never
        # imports it for text models.
        _run(
            [str(python), "-m", "pip", "uninstall", "-q", "-y", "torchvision"],
            quiet=quiet,
            what=what,
        )
        stamp.write_text(wanted)
    return python


# --- helpers --------------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run(cmd: Sequence[str], *, quiet: bool, what: str, env: dict[str, str] | None = None) -> None:
    if not quiet:
        if subprocess.run(cmd, env=env).returncode != 0:
            raise ConversionError(f"{what} failed: {' '.join(cmd)}")
        return
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise ConversionError(f"{what} failed (exit {proc.returncode}):\n{tail}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="convert-openvino",
        description="Export a Hugging Face checkpoint to the OpenVINO IR OpenVINOEngine serves, "
        "into MODEL_DIR/openvino/FORMAT/ (kept if already there).",
    )
    p.add_argument("model_dir", type=Path)
    p.add_argument("--weight-format", default="int8", choices=WEIGHT_FORMATS)
    p.add_argument("--out", type=Path, help="IR directory (default: MODEL_DIR/openvino/FORMAT)")
    p.add_argument("--force", action="store_true", help="convert again even if the IR exists")
    p.add_argument(
        "--quiet", action="store_true", help="show the exporter's output only on failure"
    )
    args = p.parse_args(argv)
    ov = Settings.load().openvino
    started = time.monotonic()
    try:
        path = ensure_ir(
            args.model_dir,
            args.weight_format,
            out_dir=args.out,
            python=ov.export_python or None,
            export_venv=ov.export_venv or None,
            force=args.force,
            quiet=args.quiet,
        )
    except (ConversionError, FileNotFoundError, ValueError) as e:
        print(f"convert-openvino: {e}", file=sys.stderr)
        return 1
    print(f"{path} ({time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
