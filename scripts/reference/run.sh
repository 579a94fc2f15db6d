#!/usr/bin/env bash
# Measure the reference library (hivemind 1.1.12) on this machine, in its own venv (created if missing),
# so that this project's benchmarks can be compared with it as ratios taken in the same sitting.
# Usage: scripts/reference/run.sh [hivemind_bench.py flags]   e.g. --peers 2,4 --skip-dht
# Env: REFERENCE_DIR (default ~/.cache/dedloc-reference), PYTHON (default python3),
#      OUT (default: $REFERENCE_DIR/hivemind_results.json)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REFERENCE_DIR="${REFERENCE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dedloc-reference}"
PYTHON="${PYTHON:-python3}"
OUT="${OUT:-$REFERENCE_DIR/hivemind_results.json}"
VENV="$REFERENCE_DIR/venv"

if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p "$REFERENCE_DIR"
  "$PYTHON" -m venv "$VENV"
  # torch first: an exact pin that your package index resolves to the build you want (on a CPU-only
  # machine, a CPU wheel); hivemind's own "torch>=1.9.0" is then already satisfied. Set TORCH_SPEC to
  # change it.
  "$VENV/bin/pip" install -q "${TORCH_SPEC:-torch==2.13.0}"
  "$VENV/bin/pip" install -q hivemind==1.1.12
fi

"$VENV/bin/python" -c "import hivemind, torch; print('hivemind', hivemind.__version__, 'torch', torch.__version__)" >&2
exec "$VENV/bin/python" "$HERE/hivemind_bench.py" --out "$OUT" "$@"
