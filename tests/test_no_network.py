"""No code from the network: lcsb switches off transformers' hub kernels and makes the `kernels` package
unimportable (bitsandbytes calls it directly on AVX512-BF16 CPUs to fetch a kernel from the hub), so a run
never downloads and executes code the user did not install."""

import os
import subprocess
import sys

import pytest
from helpers import LAMP2, REPO

NO_SOCKETS_TRAIN = """
import socket, sys

def refuse(*args, **kwargs):
    print("NETWORK", args, file=sys.stderr)
    raise OSError("the test refuses the network")

socket.socket.connect = socket.socket.connect_ex = refuse
socket.create_connection = socket.getaddrinfo = refuse

from lcsb_cli.cli import app
try:
    app(["train", sys.argv[1], "quantization=nf4", "train.max_steps=1", "train.batch_size=1", "-o", sys.argv[2]])
except SystemExit as exit:
    assert not exit.code, exit.code
try:
    from kernels import get_kernel  # what bitsandbytes' CPU backend does on AVX512-BF16
except ImportError:
    print("KERNELS-BLOCKED")
from transformers.integrations.hub_kernels import _kernels_enabled
print("HUB-KERNELS", _kernels_enabled())
"""


@pytest.mark.slow
def test_a_4bit_run_with_the_hub_online_never_touches_the_network(tmp_path):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "USE_HUB_KERNELS")
    }
    proc = subprocess.run(
        [sys.executable, "-c", NO_SOCKETS_TRAIN, str(LAMP2), str(tmp_path / "run")],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "NETWORK" not in proc.stderr
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
    assert "KERNELS-BLOCKED" in proc.stdout and "HUB-KERNELS False" in proc.stdout
