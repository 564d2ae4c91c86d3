"""`lcsb export`: a run's adapter in PEFT format or as llama.cpp's adapter GGUF, or the base model with the adapter
merged in (HF, or GGUF with an Ollama Modelfile)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from . import atomic
from .errors import BadInput
from .model import adapter as adapters
from .model.gguf import adapter as gguf_adapter
from .model.gguf import write as gguf_out
from .recipe import replace_key
from .rundir import RunDir, finished_run

FORMATS = ("hf", "gguf")


def export_run(
    run_dir: Path,
    output: Path,
    merge: bool = False,
    user: str | None = None,
    fmt: str = "hf",
    outtype: str | None = None,
    modelfile: bool = False,
) -> Path:
    """Write `output` atomically (a new or empty dir; for GGUF a new file), filled beside it and renamed. An adapter
    GGUF of a per-user run without `user` is a dir of USER.gguf files (see `_adapter_gguf`). With `modelfile`, a
    merged GGUF OUT.gguf gets an Ollama Modelfile OUT.Modelfile beside it."""
    _check_format(fmt, outtype, merge, modelfile)
    if fmt == "gguf" and not merge:
        return _adapter_gguf(RunDir(run_dir), output, user, outtype or "f32")
    recipe, adapter = finished_run(run_dir, user)
    if fmt == "gguf":
        _check_gguf_output(output, modelfile)
        _check_gguf_architecture(recipe)
        atomic.write_file(output, lambda tmp: _merged_gguf(recipe, adapter, tmp, outtype or "f16"))
        if modelfile:
            _write_modelfile(output)
        return output
    _check_new_dir(output)
    if merge:
        atomic.write_dir(output, lambda tmp: _merged_hf(recipe, adapter, tmp))
    else:
        checked_adapter(recipe, adapter)
        atomic.write_dir(output, lambda tmp: shutil.copytree(adapter, tmp, dirs_exist_ok=True))
    return output


def _check_format(fmt: str, outtype: str | None, merge: bool, modelfile: bool) -> None:
    if fmt not in FORMATS:
        raise BadInput(f"--format: {fmt!r} is not one of {', '.join(FORMATS)}")
    if modelfile and (fmt != "gguf" or not merge):
        raise BadInput(
            "--modelfile goes with --merge --format gguf: Ollama 0.34.1 and later create no model from a LoRA adapter "
            "(ADAPTER), so its FROM is a merged GGUF; serve an adapter GGUF with llama-server --lora instead"
        )
    if outtype is not None and fmt != "gguf":
        raise BadInput("--outtype applies to --format gguf only")
    outtypes = gguf_out.OUTTYPES if merge else tuple(gguf_adapter.OUTTYPES)
    if outtype is not None and outtype not in outtypes:
        kind = "a merged GGUF" if merge else "an adapter GGUF"
        raise BadInput(f"--outtype: {outtype!r} is not one of {', '.join(outtypes)} (for {kind})")


def _check_new_file(path: Path) -> None:
    if path.exists():
        raise BadInput(f"--output: {path} exists; name a new .gguf file")


def _check_new_dir(path: Path) -> None:
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise BadInput(f"--output: {path} exists and is not empty; choose a new directory")


def _adapter_gguf(run: RunDir, output: Path, user: str | None, outtype: str) -> Path:
    """llama.cpp's adapter GGUF: one file for a run or for `user` of a per-user run; for a per-user run without
    `user`, `output` is a new or empty dir holding USER.gguf for every user whose adapter is finished."""
    if user is None and run.adapters.is_dir():
        return _users_gguf(run, output, outtype)
    if user is not None and run.is_run():
        # an unknown user is named as such (BadInput), not as an unfinished run
        run.adapter_of(user, per_user=True)
    recipe, adapter = finished_run(run.root, user)
    _check_new_file(output)
    base = gguf_adapter.base_of(recipe)
    name, checked = _gguf_name(recipe, user), checked_adapter(recipe, adapter)
    atomic.write_file(output, lambda tmp: gguf_adapter.write_adapter(checked, base, tmp, outtype, name))
    return output


def _check_gguf_output(output: Path, with_modelfile: bool) -> None:
    """A new file; with a Modelfile, OUT.gguf beside a new OUT.Modelfile."""
    if with_modelfile and output.suffix != ".gguf":
        raise BadInput(f"--output: with --modelfile name the model OUT.gguf (the Modelfile is OUT.Modelfile): {output}")
    for path in [output, _modelfile_path(output)] if with_modelfile else [output]:
        _check_new_file(path)


def _users_gguf(run: RunDir, output: Path, outtype: str) -> Path:
    """USER.gguf for every finished user of a per-user run, in one new dir."""
    users = sorted(p.name for p in run.adapters.iterdir() if (p / "adapter_config.json").is_file())
    if not users:
        raise BadInput(f"{run.adapters}: no user's adapter to export yet; finish the run first")
    recipe, _ = finished_run(run.root, users[0])
    _check_new_dir(output)
    base = gguf_adapter.base_of(recipe)
    checked = {user: checked_adapter(recipe, run.user_adapter(user)) for user in users}

    def write(tmp: Path) -> None:
        for user in users:
            name = _gguf_name(recipe, user)
            gguf_adapter.write_adapter(checked[user], base, tmp / f"{user}.gguf", outtype, name)

    atomic.write_dir(output, write)
    return output


def _gguf_name(recipe, user: str | None) -> str:
    """general.name of an adapter GGUF: the run's name, and the user's."""
    return recipe.name if user is None else f"{recipe.name}-{user}"


def _modelfile_path(gguf_file: Path) -> Path:
    return gguf_file.with_suffix(".Modelfile")


def _write_modelfile(gguf_file: Path) -> None:
    """The Modelfile beside `gguf_file`; the GGUF goes too if it cannot be written, so neither is left alone."""
    try:
        atomic.write_text_atomic(_modelfile_path(gguf_file), gguf_out.modelfile(gguf_file))
    except BaseException:
        gguf_file.unlink()
        raise


def _check_gguf_architecture(recipe) -> None:
    """Refuse an unsupported architecture before any weight is loaded."""
    from .model.load import check_causal_lm, resolve_base_dir

    base_dir = resolve_base_dir(recipe.model.name, recipe.model.dtype)
    gguf_out.check_exportable(check_causal_lm(base_dir, recipe.model.trust_remote_code).model_type)


def checked_adapter(recipe, adapter: Path) -> adapters.Adapter:
    """The run's adapter, checked against its base's config (on the meta device: no weights are loaded)."""
    from .model.load import check_causal_lm, resolve_base_dir

    trust = recipe.model.trust_remote_code
    config = check_causal_lm(resolve_base_dir(recipe.model.name, recipe.model.dtype), trust)
    return adapters.check_for_base(adapter, config, trust)


def merged_model(recipe, adapter: Path):
    """(base + adapter merged, base checkpoint dir). Merging needs full-precision base weights: the base is loaded
    unquantized in the recipe's dtype."""
    from .model.load import load_base

    base, _, base_dir = load_base(replace_key(recipe, "quantization", "none"), torch.device("cpu"))
    merged = adapters.load(base, adapter).merge_and_unload()
    merged.config.use_cache = True
    return merged, base_dir


def _merged_hf(recipe, adapter: Path, target: Path) -> None:
    from .model.tokenizer import load_tokenizer

    merged, base_dir = merged_model(recipe, adapter)
    tokenizer = load_tokenizer(base_dir)
    # a base without them would never stop generating
    for config in (merged.config, merged.generation_config):
        config.eos_token_id = config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_token_id
        config.pad_token_id = config.pad_token_id if config.pad_token_id is not None else tokenizer.pad_token_id
    merged.save_pretrained(target)
    tokenizer.save_pretrained(target)


def _merged_gguf(recipe, adapter: Path, target: Path, outtype: str) -> None:
    from .model.load import gguf_source

    merged, base_dir = merged_model(recipe, adapter)
    gguf_out.write_gguf(merged, base_dir, target, outtype, gguf_source(recipe.model.name))
