"""`lcsb export`: a run's adapter in PEFT format, or the base model with the adapter merged in."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from .errors import BadInput
from .recipe import load_recipe, replace_key


def export_run(run_dir: Path, output: Path, merge: bool = False, user: str | None = None) -> Path:
    """Write into `output` (new or empty) atomically: a temp dir beside it, renamed when complete."""
    if not (run_dir / "config.yaml").is_file():
        raise BadInput(f"{run_dir}: not a run directory (no config.yaml)")
    adapter = run_dir / "adapters" / user if user else run_dir / "adapter"
    if not (adapter / "adapter_config.json").is_file():
        hint = " (a per-user run: pass --user ID)" if (run_dir / "adapters").is_dir() and not user else ""
        raise BadInput(f"{adapter}: no adapter to export{hint}; finish the run first")
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise BadInput(f"--output: {output} exists and is not empty; choose a new directory")
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}."))
    try:
        if merge:
            _merged(load_recipe(run_dir / "config.yaml"), adapter, tmp)
        else:
            shutil.copytree(adapter, tmp, dirs_exist_ok=True)
        if output.exists():
            output.rmdir()
        tmp.rename(output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output


def _merged(recipe, adapter: Path, target: Path) -> None:
    """Merging needs full-precision base weights: the base is loaded unquantized in the recipe's dtype."""
    from peft import PeftModel

    from .models import load_base, load_tokenizer

    base, _, base_dir = load_base(replace_key(recipe, "quantization", "none"), torch.device("cpu"))
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    merged.config.use_cache = True
    merged.save_pretrained(target)
    load_tokenizer(base_dir).save_pretrained(target)
