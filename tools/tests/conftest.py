"""The tools' own tests (the build tools that regenerate committed files, and the measurement tools), apart from the
product suite in tests/: scripts/test.sh runs them in a second pytest process, so tools/build/ is on sys.path here
and never in the product suite."""

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["LCSB_CPU_BF16"] = "emulated"
if "LCSB_CACHE" not in os.environ:
    os.environ["LCSB_CACHE"] = tempfile.mkdtemp(prefix="lcsb-tools-test-cache-")
    atexit.register(shutil.rmtree, os.environ["LCSB_CACHE"], ignore_errors=True)

REPO = Path(__file__).resolve().parents[2]
# synthetic.py and the sample writers import each other by name, as when they run as scripts
sys.path.insert(0, str(REPO / "tools" / "build"))
