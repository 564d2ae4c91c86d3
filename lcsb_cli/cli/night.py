"""`lcsb night`: the nightly lineage's verb (run/lineage.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..paths import recipe_file
from ..recipe import load_recipe, with_autocast_chosen
from .app import Overrides, RecipeArg, app, err, handled, out


@app.command()
@handled
def night(
    recipe: RecipeArg,
    overrides: Overrides = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="The lineage dir (default: the recipe's output_dir).")
    ] = None,
) -> None:
    """Tonight's night of a lineage: learn the items that came in since the last night on top of the promoted
    adapter, and promote the new adapter only if its held-out score did not drop; the same command every night.

    `data.user=all` (on the command line) runs every user's lineage of the data, each in DIR/users/ID.
    A night cut short (window end, SIGTERM, kill -9) continues when the command runs again. The lineage dir works as
    a run dir for eval, generate, chat and export (its adapter is the promoted one). Example, from cron:
    `30 1 * * * lcsb night recipes/overnight.yaml -o ~/lcsb/alex`."""
    from ..display import RichDisplay
    from ..run.lineage import night as run_night
    from ..run.lineage import nights_per_user

    # a jsonl recipe refuses data.user=all (single runs); here it means one lineage per user, in DIR/users/ID
    per_user = PER_USER in (overrides or [])
    overrides = [o for o in overrides or [] if o != PER_USER]
    loaded, autocast = with_autocast_chosen(load_recipe(recipe_file(recipe), overrides))
    root = Path(output if output is not None else loaded.output_dir)
    display = RichDisplay(err, [autocast])
    if per_user:
        for user, record in nights_per_user(loaded, root, display).items():
            _say(record, root / "users" / user, f"{user}: ")
    else:
        _say(run_night(loaded, root, display), root, "")


PER_USER = "data.user=all"


def _say(record: dict, root: Path, prefix: str) -> None:
    """The morning line of one lineage, or how to finish a night cut short."""
    from ..run.lineage import morning_line, read_state

    if record.get("stopped"):
        out.print(f"{prefix}night {record['night']} stopped ({record['stopped']}); run the same command to finish it")
    else:
        out.print(prefix + morning_line(record, read_state(root)), highlight=False, soft_wrap=True)
