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
    adapter, and promote the new adapter only if held-out accuracy did not drop; the same command every night.

    A night cut short (window end, SIGTERM, kill -9) continues when the command runs again. The lineage dir works as
    a run dir for eval, generate, chat and export (its adapter is the promoted one). Example, from cron:
    `30 1 * * * lcsb night recipes/overnight.yaml -o ~/lcsb/alex`."""
    from ..report import RichReporter
    from ..run.lineage import morning_line, read_state
    from ..run.lineage import night as run_night

    loaded, autocast = with_autocast_chosen(load_recipe(recipe_file(recipe), overrides or []))
    root = Path(output if output is not None else loaded.output_dir)
    record = run_night(loaded, root, RichReporter(err, [autocast]))
    if record.get("stopped"):
        out.print(f"night {record['night']} stopped ({record['stopped']}); run the same command to finish it")
        return
    out.print(morning_line(record, read_state(root)), highlight=False, soft_wrap=True)
