"""The study's own tests, apart from the product suite in tests/ (scripts/test.sh runs them in a second pytest
process)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
