# Sourced by the scripts in scripts/: makes sure the repo's .venv exists and holds the
# project (editable, with dev extras) at the version pyproject.toml asks for.
# Sets ROOT and PY.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${MESHSERVE_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
# The development tools (bench/, devtools/) are not installed with the project: they run
# from the checkout.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# torch reads this once, at start: processes that run an engine in-process (benchmarks, tests)
# get the huge pages a TE gets from its settings (torch.huge_pages in shared/settings.py).
export THP_MEM_ALLOC_ENABLE="${THP_MEM_ALLOC_ENABLE:-1}"

ensure_venv() {
  local stamp="$VENV/.meshserve-installed"
  if [[ ! -x "$PY" ]]; then
    echo "meshserve: creating $VENV" >&2
    python3 -m venv "$VENV"
  fi
  if [[ ! -f "$stamp" || "$ROOT/pyproject.toml" -nt "$stamp" ]]; then
    echo "meshserve: installing dependencies into $VENV (first run takes a minute)" >&2
    "$PY" -m pip install -q --upgrade pip >&2
    # torch first and pinned. On this project's machines 2.13.0 resolves to a local CPU
    # wheel; any other request (or an index without that wheel) pulls a multi-GB CUDA build.
    "$PY" -m pip install -q "torch==2.13.0" >&2
    "$PY" -m pip install -q -e "$ROOT[dev]" "torch==2.13.0" >&2
    touch "$stamp"
  fi
}
