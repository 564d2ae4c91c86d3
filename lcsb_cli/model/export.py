"""`lcsb export`: a run's adapter in PEFT format, or the base model with the adapter merged in (HF or GGUF)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from .. import atomic
from ..errors import BadInput
from ..recipe import replace_key
from ..run.rundir import finished_run
from . import gguf_out

FORMATS = ("hf", "gguf")


def export_run(
    run_dir: Path,
    output: Path,
    merge: bool = False,
    user: str | None = None,
    fmt: str = "hf",
    outtype: str | None = None,
) -> Path:
    """Write `output` atomically (a new or empty dir; for GGUF a new file), filled beside it and renamed."""
    recipe, adapter = finished_run(run_dir, user)
    _check_format(fmt, outtype, merge)
    if fmt == "gguf":
        if output.exists():
            raise BadInput(f"--output: {output} exists; name a new .gguf file")
        _check_gguf_architecture(recipe)
        atomic.write_file(output, lambda tmp: _merged_gguf(recipe, adapter, tmp, outtype or "f16"))
        return output
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise BadInput(f"--output: {output} exists and is not empty; choose a new directory")
    if merge:
        atomic.write_dir(output, lambda tmp: _merged_hf(recipe, adapter, tmp))
    else:
        atomic.write_dir(output, lambda tmp: shutil.copytree(adapter, tmp, dirs_exist_ok=True))
    return output


def _check_format(fmt: str, outtype: str | None, merge: bool) -> None:
    if fmt not in FORMATS:
        raise BadInput(f"--format: {fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt == "gguf" and not merge:
        raise BadInput("--format gguf writes a merged model: add --merge")
    if outtype is not None and fmt != "gguf":
        raise BadInput("--outtype applies to --format gguf only")
    if outtype is not None and outtype not in gguf_out.OUTTYPES:
        raise BadInput(f"--outtype: {outtype!r} is not one of {', '.join(gguf_out.OUTTYPES)}")


def _check_gguf_architecture(recipe) -> None:
    """Refuse an unsupported architecture before any weight is loaded."""
    from .load import check_causal_lm, resolve_base_dir

    base_dir = resolve_base_dir(recipe.model.name, recipe.model.dtype)
    gguf_out.check_exportable(check_causal_lm(base_dir, recipe.model.trust_remote_code).model_type)


def merged_model(recipe, adapter: Path):
    """(base + adapter merged, base checkpoint dir). Merging needs full-precision base weights: the base is loaded
    unquantized in the recipe's dtype."""
    from peft import PeftModel

    from .load import load_base

    base, _, base_dir = load_base(replace_key(recipe, "quantization", "none"), torch.device("cpu"))
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    merged.config.use_cache = True
    return merged, base_dir


def _merged_hf(recipe, adapter: Path, target: Path) -> None:
    from .load import load_tokenizer

    merged, base_dir = merged_model(recipe, adapter)
    tokenizer = load_tokenizer(base_dir)
    # a base without them would never stop generating
    for config in (merged.config, merged.generation_config):
        config.eos_token_id = config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_token_id
        config.pad_token_id = config.pad_token_id if config.pad_token_id is not None else tokenizer.pad_token_id
    merged.save_pretrained(target)
    tokenizer.save_pretrained(target)


def _merged_gguf(recipe, adapter: Path, target: Path, outtype: str) -> None:
    from .load import gguf_source

    merged, base_dir = merged_model(recipe, adapter)
    gguf_out.write_gguf(merged, base_dir, target, outtype, gguf_source(recipe.model.name))
