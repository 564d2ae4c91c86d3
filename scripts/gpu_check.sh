#!/usr/bin/env bash
# Every cuda claim of issue 52 in one go (scripts/gpu_check.py lists them), one JSON report; sized for under 8
# minutes on one H100 (not yet run on one). On a GPU machine with torch, transformers, peft, rich, typer and pyyaml
# but no network:
#   here, with the package index:  scripts/gpu_check.sh --prepare   (.whl/: the wheels that machine lacks, ~22 MiB)
#   there, from this checkout's root, .whl/ carried along:
#     scripts/gpu_check.sh --out /tmp/gpu_check --report REPORT.json [--only STEP,STEP]
# The wheels are installed into a temporary dir ahead of the machine's own packages and lcsb runs from this checkout
# (PYTHONPATH): nothing is installed into the machine's Python. --dry-run: the same steps on the cpu backend, small
# (tests/test_gpu_check.py runs it). PYTHON picks the interpreter (python3), WHEELS the wheel dir (.whl).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
if [ "${1:-}" = "--prepare" ]; then
  exec "$PYTHON" scripts/gpu_check.py --prepare "$WHEELS"
fi
temp=()
trap 'rm -rf "${temp[@]}"' EXIT
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  site=$(mktemp -d) && temp+=("$site")
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$WHEELS"/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ -z "${LCSB_CACHE:-}" ]; then
  LCSB_CACHE=$(mktemp -d) && temp+=("$LCSB_CACHE")
  export LCSB_CACHE
fi
# lcsb from this checkout; cuBLAS's fixed workspace for the deterministic steps (torch.use_deterministic_algorithms)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
"$PYTHON" scripts/gpu_check.py "$@"
