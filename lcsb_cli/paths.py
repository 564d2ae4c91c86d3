"""Where the shipped files are (recipes and their sample data, model presets with the lamp-tiny checkpoint, the
tokenizer, device profiles): package data under lcsb_cli/shipped/, so an installed wheel has them as a checkout
does (the checkout's recipes/ and configs/ link there)."""

from importlib.resources import files
from pathlib import Path

SHIPPED = Path(str(files("lcsb_cli") / "shipped"))
RECIPES_DIR = SHIPPED / "recipes"
CONFIGS_DIR = SHIPPED / "configs"
