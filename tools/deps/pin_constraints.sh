#!/usr/bin/env bash
# Rewrites constraints.txt: the exact version of every package that a fresh `pip install -e '.[test]'` resolves now
# (the newest that pyproject.toml allows), plus the real base package the tests use. README's two commands and CI
# install with it, so a fresh machine gets the versions the tests last passed with.
# Raise the pins this way: tools/deps/check_latest.sh passes -> tools/deps/pin_constraints.sh -> README's test command.
set -euo pipefail
cd "$(dirname "$0")/../.."
source tools/deps/newest_venv.sh
{
  echo "# Exact versions for README's install commands and CI; made by tools/deps/pin_constraints.sh (do not edit)."
  echo "# Python $("$venv/bin/python" -c 'import platform; print(platform.python_version())'), $(date -u +%Y-%m-%d)."
  # the CPU wheel's local label (+cpu) is dropped: `torch==2.13.0` matches the CPU wheel and nothing newer
  "$venv/bin/pip" freeze --exclude-editable | sed -E 's/\+cpu$//'
} > constraints.txt
echo "constraints.txt: $(grep -vc '^#' constraints.txt) packages pinned"
