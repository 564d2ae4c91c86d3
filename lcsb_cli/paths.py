"""Where the shipped files are (recipes and their sample data, model presets with the lamp-tiny checkpoint, the
tokenizer, device profiles): package data under lcsb_cli/shipped/, so an installed wheel has them as a checkout
does (the checkout's recipes/ and configs/ link there)."""

import os
from importlib.resources import files
from pathlib import Path

SHIPPED = Path(str(files("lcsb_cli") / "shipped"))
RECIPES_DIR = SHIPPED / "recipes"
CONFIGS_DIR = SHIPPED / "configs"


def cache_root() -> Path:
    """Where converted models and compiled NPU graphs are kept: $LCSB_CACHE, else ~/.cache/lcsb."""
    return Path(os.environ.get("LCSB_CACHE", Path.home() / ".cache" / "lcsb"))


def recipe_file(arg: str) -> Path:
    """A recipe argument as a path: the file given, or else the shipped recipe of that name (`lamp2`)."""
    path, shipped = Path(arg), RECIPES_DIR / f"{arg}.yaml"
    return shipped if not path.exists() and shipped.is_file() else path
