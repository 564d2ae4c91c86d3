"""The tools' own tests (the build tools that regenerate committed files, and the measurement tools), apart from the
product suite in tests/: scripts/test.sh runs them in a second pytest process, so tools/build/ is on sys.path here
and never in the product suite."""

import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
# train.autocast: auto resolves alike on every host (none), as in the product suite
os.environ["LCSB_CPU_BF16"] = "emulated"
# synthetic.py and the sample writers import each other by name, as when they run as scripts
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "build"))
