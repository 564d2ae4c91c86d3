"""What importing the training path costs, in RSS, each figure from a fresh process (docs/memory.md, Imports).

    python tools/measure/import_costs.py

Each row imports the modules above it, then its own, and prints the RSS before and after the row's import, with
the libraries' defaults and as lcsb runs them (`TORCHDYNAMO_DISABLE=1`, set by `import lcsb_cli`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

TRAINING_PATH = [
    "torch",
    "transformers",
    "transformers.models.qwen2.modeling_qwen2",
    "bitsandbytes",
    "peft",
    "lcsb_cli.run.engine",
]
# loaded only by the verbs and formats that use them
OFF_PATH = ["datasets", "matplotlib.pyplot", "onnxruntime"]

PROBE = """
import importlib, json, sys
def rss():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20
for name in sys.argv[1:-1]:
    importlib.import_module(name)
before = rss()
importlib.import_module(sys.argv[-1])
print(json.dumps([before, rss()]))
"""


def rss_around_last_import(modules: list[str], dynamo_disabled: bool) -> tuple[float, float]:
    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
    if dynamo_disabled:
        env["TORCHDYNAMO_DISABLE"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *modules], env=env, capture_output=True, text=True, check=True
    ).stdout
    return tuple(json.loads(out.splitlines()[-1]))


def main() -> None:
    print("| import | defaults: MiB before | MiB after | as lcsb runs: MiB before | MiB after |")
    print("| --- | --- | --- | --- | --- |")
    rows = [TRAINING_PATH[: i + 1] for i in range(len(TRAINING_PATH))]
    rows += [TRAINING_PATH + [name] for name in OFF_PATH]
    for modules in rows:
        default, lean = (
            rss_around_last_import(modules, dynamo_disabled=False),
            rss_around_last_import(modules, dynamo_disabled=True),
        )
        print(f"| {modules[-1]} | {default[0]:.0f} | {default[1]:.0f} | {lean[0]:.0f} | {lean[1]:.0f} |")


if __name__ == "__main__":
    main()
