"""The lean runtime: what a training process imports."""

import json
import os
import subprocess
import sys

from helpers import LAMP2, REPO

TRAIN_AND_LIST_MODULES = """
import json, sys
from lcsb_cli.cli import app
try:
    app(["train", sys.argv[1], "train.max_steps=1", "train.batch_size=1", "-o", sys.argv[2]])
except SystemExit as exit:
    assert not exit.code, exit.code
print(json.dumps(sorted(sys.modules)))
"""


def test_a_training_process_never_loads_the_compiler_or_the_data_and_plotting_stacks(tmp_path):
    """bitsandbytes' import-time torch.compile would load inductor's compiler; datasets (pyarrow, pandas) and
    matplotlib belong to the formats and verbs that use them. The process starts without TORCHDYNAMO_DISABLE in its
    environment: lcsb sets it itself."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
    out = subprocess.run([sys.executable, "-c", TRAIN_AND_LIST_MODULES, str(LAMP2), str(tmp_path / "run")], env=env,
                         cwd=REPO, capture_output=True, text=True, check=True, timeout=300)
    modules = set(json.loads(out.stdout.splitlines()[-1]))
    assert "peft" in modules and "bitsandbytes" in modules  # the path under test really was the training one
    loaded = {name for name in modules if name.split(".")[0] in ("datasets", "pyarrow", "pandas", "matplotlib")}
    assert not loaded
    assert "torch._inductor.compile_fx" not in modules
