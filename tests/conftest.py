import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
# train.autocast: auto resolves alike on every host (none); tests of the choice pass cpuinfo text themselves
os.environ["LCSB_CPU_BF16"] = "emulated"
# one cache per session (xdist workers inherit it), removed when it ends
if "LCSB_CACHE" not in os.environ:
    os.environ["LCSB_CACHE"] = tempfile.mkdtemp(prefix="lcsb-test-cache-")
    atexit.register(shutil.rmtree, os.environ["LCSB_CACHE"], ignore_errors=True)

import pytest

from lcsb_cli.runtime import install

# the process settings the `lcsb` entry point installs, for the tests that call lcsb in-process
install()

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


@pytest.fixture
def repo() -> Path:
    return REPO
