#!/usr/bin/env bash
# Opt-in check before raising a pin (then run tools/deps/pin_constraints.sh): installs the NEWEST versions that
# pyproject.toml allows, without constraints.txt, into a throw-away venv, and runs the quick tests that catch
# dependency drift (bad input and its one-line stderr, no network, recipes, the LCSB core, a short training run).
set -euo pipefail
cd "$(dirname "$0")/../.."
source tools/deps/newest_venv.sh
"$venv/bin/pip" freeze --exclude-editable | diff <(grep -v '^#' constraints.txt) - | grep '^[<>]' || true
HF_HUB_OFFLINE=1 "$venv/bin/python" -m pytest -q -n 2 --dist loadgroup tests/test_bad_input.py \
  tests/test_no_network.py tests/test_recipe_cli.py tests/test_selective.py tests/test_train.py
