"""What eval, generate, chat and export name on the command line, resolved to a recipe, an adapter and a run."""

from __future__ import annotations

from pathlib import Path

from ..errors import BadInput
from ..paths import recipe_file
from ..recipe import Recipe, load_recipe, replace_key
from .layout import RunDir


def resolve_target(
    target: str, overrides: list[str], adapter: Path | None, user: str | None = None, model_dir_ok: bool = False
) -> tuple[Recipe, Path | None, Path | None]:
    """(recipe, adapter, run dir) of eval's and generate's TARGET: a recipe file or shipped name (the base model, or
    --adapter); a run dir (its config.yaml and adapter/, or adapters/USER/; a per-user run without --user: no
    adapter); with model_dir_ok, a merged export (an HF dir without config.yaml: the default recipe on it)."""
    path = Path(target)
    if adapter is not None and user is not None:
        raise BadInput("--adapter and --user both name an adapter; give one")
    if not path.is_dir():
        if not path.exists() and not recipe_file(target).is_file():
            raise BadInput(f"{target}: not found; give a recipe file, a shipped recipe (`lcsb recipes`) or a run dir")
        if user is not None:
            raise BadInput("--user: picks a user's adapter in a per-user run dir; give the run dir")
        return load_recipe(recipe_file(target), overrides), adapter, None
    run = RunDir(path)
    if run.is_run():
        recipe = load_recipe(run.config, overrides)
        return recipe, adapter or run.adapter_of(user, recipe.data.user == "all"), path
    if model_dir_ok and (path / "config.json").is_file():
        return _model_dir_recipe(path, overrides), adapter, None
    merged = " or a merged model dir (config.json)" if model_dir_ok else ""
    raise BadInput(f"{path}: not a run directory (no config.yaml); give a recipe, a run dir{merged}")


def _model_dir_recipe(model_dir: Path, overrides: list[str]) -> Recipe:
    """A merged export carries no recipe: the defaults, with model.name pointing at it."""
    if overrides:
        raise BadInput(
            f"{model_dir}: a model dir takes no KEY=VALUE overrides; give a recipe and "
            f"model.name={model_dir} with them instead"
        )
    return replace_key(Recipe(name=model_dir.name), "model.name", str(model_dir.resolve()))


def finished_run(run_dir: Path, user: str | None) -> tuple[Recipe, Path]:
    """(recipe, adapter) of a run dir that export reads: its config.yaml and adapter/ or adapters/USER/."""
    run = RunDir(run_dir)
    if not run.is_run():
        raise BadInput(f"{run_dir}: not a run directory (no config.yaml)")
    adapter = run.user_adapter(user) if user else run.adapter
    if not (adapter / "adapter_config.json").is_file():
        hint = " (a per-user run: pass --user ID)" if run.adapters.is_dir() and not user else ""
        raise BadInput(f"{adapter}: no adapter to export{hint}; finish the run first")
    return load_recipe(run.config), adapter
