"""Warm start (`lora.init`): a run trains on from an adapter it did not make, with a fresh optimizer and schedule.

The source is a run dir (its adapter/), one user's adapter of a per-user run (`lora.init_user`, or the run's own
`data.user`), a PEFT adapter dir or an adapter GGUF. It is read only through model/adapter.py, then checked against
this run: the same base (its name, its shape and, for a GGUF base, a hash of the GGUF's tensor table, as the
source's run recorded them in summary.json's `base`), the same rank, alpha and targets. The adapter's hash goes into
config.yaml (`lora.init_sha256`) when the run starts, so a resume keeps it and never reads the source again: the
checkpoint holds the trained adapter.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..errors import BadInput
from ..model import adapter as adapters
from ..model.gguf.index import GgufIndex
from ..model.load import gguf_source, portable_name
from ..recipe import Recipe, replace_key
from ..rundir import RunDir

FRESH = "warm-start from an adapter of this base and LoRA shape, or drop lora.init to start fresh"


@dataclass(frozen=True)
class Init:
    """Where a warm start's adapter is, whose it is, and the base its run recorded (None when unknown)."""

    adapter: Path
    user: str | None
    base: dict | None


def pinned(recipe: Recipe, run_dir: Path, resume: bool) -> Recipe:
    """`recipe` with lora.init_sha256 filled in: the source adapter's hash on a fresh run, config.yaml's on a resume
    (the source is not read again)."""
    lora = recipe.lora
    if lora.init is None:
        if lora.init_user is not None:
            raise BadInput("lora.init_user: names a user of the per-user run in lora.init, which is not set")
        return recipe
    if resume:
        saved = yaml.safe_load(RunDir(run_dir).config.read_text()) if RunDir(run_dir).is_run() else None
        recorded = ((saved or {}).get("lora") or {}).get("init_sha256")
        return replace_key(recipe, "lora.init_sha256", lora.init_sha256 or recorded)
    init = source(recipe)
    digest = adapter_hash(init.adapter)
    if lora.init_sha256 not in (None, digest):
        raise BadInput(
            f"lora.init: {init.adapter} has sha256 {digest[:16]}, not the pinned lora.init_sha256 "
            f"{lora.init_sha256[:16]}; the adapter changed since it was pinned"
        )
    return replace_key(recipe, "lora.init_sha256", digest)


def source(recipe: Recipe) -> Init:
    """The adapter lora.init names, resolved from a run dir, a per-user run's user, or an adapter path."""
    path = Path(recipe.lora.init)
    if not path.exists():
        raise BadInput(f"lora.init: {path} does not exist; name a run dir, a PEFT adapter dir or an adapter .gguf")
    run = RunDir(path)
    explicit = recipe.lora.init_user
    if not run.is_run():
        if explicit is not None:
            raise BadInput(f"lora.init_user: {path} is one adapter, not a per-user run; drop lora.init_user")
        return Init(path, None, recorded_base(_owning_run(path)))
    saved = yaml.safe_load(run.config.read_text()) or {}
    if (saved.get("data") or {}).get("user") != "all":
        if explicit is not None:
            raise BadInput(f"lora.init_user: {path} is a run of one adapter, not a per-user run; drop lora.init_user")
        if not run.adapter.is_dir():
            raise BadInput(f"lora.init: {path} has no adapter/ yet; finish that run first")
        return Init(run.adapter, None, recorded_base(run))
    user = explicit or (recipe.data.user if recipe.data.user not in (None, "all") else None)
    users = sorted(p.name for p in run.adapters.glob("*")) if run.adapters.is_dir() else []
    if user is None:
        raise BadInput(
            f"lora.init: {path} is a per-user run (users: {', '.join(users) or 'none trained'}); name one with "
            "lora.init_user=ID"
        )
    if user not in users:
        raise BadInput(f"lora.init_user: {path} has no adapter for user {user!r} (users: {', '.join(users)})")
    return Init(run.user_adapter(user), user, recorded_base(run.user(user)))


def start_from(recipe: Recipe, model) -> Init:
    """Put lora.init's adapter into the fresh PeftModel `model`, once its base and LoRA shape are this run's."""
    init = source(recipe)
    adapter = adapters.read(init.adapter, model.get_base_model())
    _check_base(init, adapter.config.base_model_name_or_path, base_identity(recipe, model))
    _check_lora(init.adapter, adapter.config, model.active_peft_config)
    adapters.apply(model, adapter.tensors, init.adapter)
    return init


def base_identity(recipe: Recipe, model) -> dict:
    """What names a base for warm starts: its name as adapters write it, [layers, hidden, vocab] and, for a GGUF
    base, the sha256 of its tensor table (each tensor's name, type and shape)."""
    config = model.config
    identity = {
        "name": portable_name(recipe.model.name),
        "shape": [config.num_hidden_layers, config.hidden_size, config.vocab_size],
    }
    gguf_file = gguf_source(recipe.model.name)
    if gguf_file is not None:
        identity["gguf_tensors_sha256"] = tensor_table_hash(gguf_file)
    return identity


def tensor_table_hash(path: Path) -> str:
    table = GgufIndex(path).tensors.values()
    rows = "\n".join(f"{t.name} {t.tensor_type.name} {list(t.shape)}" for t in table)
    return hashlib.sha256(rows.encode()).hexdigest()


def summary_fields(recipe: Recipe, model) -> dict:
    """summary.json's `base` (this run's base identity) and, for a warm start, `init`."""
    fields = {"base": base_identity(recipe, model)}
    if recipe.lora.init is not None:
        fields["init"] = {"path": recipe.lora.init, "user": recipe.lora.init_user, "sha256": recipe.lora.init_sha256}
    return fields


def adapter_hash(path: Path) -> str:
    """sha256 of an adapter's files: an adapter GGUF, or a PEFT dir's config and weights."""
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.name.startswith("adapter_"))
    for file in files:
        digest.update(file.name.encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


def recorded_base(run: RunDir | None) -> dict | None:
    """The base identity a run's summary.json recorded, or None."""
    if run is None or not run.summary.is_file():
        return None
    return json.loads(run.summary.read_text()).get("base")


def _owning_run(adapter: Path) -> RunDir | None:
    """The run whose adapter this is: RUN/adapter, or a per-user run's adapters/ID (its run is users/ID)."""
    up = adapter.resolve().parent
    if adapter.name == "adapter" and RunDir(up).is_run():
        return RunDir(up)
    if up.name == "adapters" and RunDir(up.parent).is_run():
        return RunDir(up.parent).user(adapter.name)
    return None


def _check_base(init: Init, named: str | None, ours: dict) -> None:
    theirs = dict(init.base or {})
    theirs.setdefault("name", named)
    differing = [key for key in ours if theirs.get(key) is not None and theirs[key] != ours[key]]
    if differing:
        key = differing[0]
        raise BadInput(
            f"lora.init: {init.adapter} was trained on a base with {key} {theirs[key]}; this recipe's base has "
            f"{key} {ours[key]}; {FRESH}"
        )


def _check_lora(path: Path, theirs, ours) -> None:
    def shape(config) -> tuple:
        targets = config.target_modules
        return config.r, float(config.lora_alpha), targets if isinstance(targets, str) else ", ".join(sorted(targets))

    if shape(theirs) != shape(ours):
        r, alpha, targets = shape(theirs)
        raise BadInput(
            f"lora.init: {path} is rank {r}, alpha {alpha:g} on {targets}; this recipe's lora is rank {ours.r}, "
            f"alpha {float(ours.lora_alpha):g} on {shape(ours)[2]}; set lora.rank/alpha/targets to the adapter's, "
            "or drop lora.init to start fresh"
        )
