"""Rules of the codebase a reviewer would otherwise check by hand."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("shared", "services", "loadgen")
# Code that runs as part of the product or its tools (not the tests, which configure
# themselves from the environment they are given).
CODE = (*PRODUCT, "devtools", "bench")


def _python(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs if (ROOT / d).is_dir() for p in (ROOT / d).rglob("*.py"))


def test_only_the_settings_module_reads_the_environment():
    readers = []
    for path in _python(*CODE):
        if path == ROOT / "shared" / "settings.py":
            continue
        text = path.read_text()
        if re.search(r"\bos\.environ\b|\bos\.getenv\b|\bgetenv\(|\benviron\[", text):
            readers.append(str(path.relative_to(ROOT)))
    assert readers == [], f"read the environment outside shared/settings.py: {readers}"


def test_the_te_never_probes_its_engine():
    worker = (ROOT / "services" / "task_executor" / "worker.py").read_text()
    calls = [
        n
        for n in ast.walk(ast.parse(worker))
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id in ("getattr", "hasattr")
    ]
    assert calls == [], "worker.py asks an engine what it can do: use its declared capabilities"


def test_no_test_imports_a_benchmark():
    importers = [
        str(path.relative_to(ROOT))
        for path in _python("tests")
        if any(
            n.split(".")[0] in ("bench", "scripts") or n.startswith("bench_")
            for n in _imports(path)
        )
    ]
    assert importers == []


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module or "")
    return names


def test_the_runtime_package_ships_no_model_generator():
    assert not (ROOT / "shared" / "modelgen.py").exists()
    assert not (ROOT / "shared" / "data").exists()
    # The product never needs the development tools or the benchmarks.
    for path in _python(*PRODUCT):
        assert not [n for n in _imports(path) if n.split(".")[0] in ("devtools", "bench")], path


def test_the_readme_performance_section_fits_on_a_screen():
    text = (ROOT / "README.md").read_text()
    start = text.index("\n## Performance")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end > 0 else None].strip().splitlines()
    assert len(section) <= 40, len(section)
    assert "docs/benchmarks.md" in "\n".join(section)


def test_the_simulator_runs_without_importing_torch(tmp_path: Path) -> None:
    """`meshserve-loadgen simulate` calls the services' pure decisions (and the torch engine's
    scheduler): none of them may pull in torch or the engine."""
    import subprocess
    import sys

    from tests.shared_traces import azure_slice

    code = (
        "import sys\n"
        "from loadgen.cli import main\n"
        "try:\n"
        f"    main(['simulate', {str(azure_slice())!r}, '--max-requests', '100', "
        f"'--out', {str(tmp_path / 'sim')!r}])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'safetensors', 'transformers', 'openvino', 'vllm') "
        "or m.endswith(('torch_engine.engine', 'weight_cache.store'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
