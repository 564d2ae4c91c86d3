"""The `lcsb` command: each verb parses, loads the recipe, calls one library function and prints."""

from __future__ import annotations

import functools
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from .errors import BadInput, LcsbError
from .recipe import dump, load_recipe
from .run.rundir import check_output_dir

USAGE_ERROR = typer.BadParameter.__bases__[0]  # click's UsageError (typer may bundle its own click)


class OneLineErrors(typer.Typer):
    """Usage errors (an unknown flag, a missing option) get one line and exit 2, like every other bad input."""

    def __call__(self, *args, **kwargs):
        if not kwargs.pop("standalone_mode", True):
            return super().__call__(*args, standalone_mode=False, **kwargs)
        try:
            code = super().__call__(*args, standalone_mode=False, **kwargs)
        except USAGE_ERROR as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # plain `lcsb`: the help text, as asked
                exc.show()
                sys.exit(exc.exit_code)
            where = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx else ""
            err.print(f"[red]error:[/] {escape(exc.format_message())}{where}", highlight=False, soft_wrap=True)
            sys.exit(2)
        except typer.Abort:
            err.print("aborted", highlight=False)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


app = OneLineErrors(add_completion=False, no_args_is_help=True, help="LoRA fine-tuning with layer-cyclic selective backprop.")
err = Console(stderr=True)
out = Console()
STATE = {"debug": False}
RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"

RecipeArg = Annotated[str, typer.Argument(help="A recipe YAML file, or the name of a shipped recipe (see `lcsb recipes`).")]
Overrides = Annotated[Optional[list[str]], typer.Argument(help="Dotted KEY=VALUE overrides, e.g. train.max_steps=20 lcsb.blocks=2.")]


@app.callback()
def main(debug: Annotated[bool, typer.Option("--debug", help="Show the traceback of any error.")] = False) -> None:
    STATE["debug"] = debug


def handled(fn):
    """Turn LcsbError into one line on stderr and its exit code; anything else exits 1 the same way."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LcsbError as exc:
            _fail(exc, exc.exit_code)
        except KeyboardInterrupt:
            _fail("interrupted", 130)
        except Exception as exc:  # noqa: BLE001 - the CLI boundary: report, never dump a traceback by default
            _fail(f"{type(exc).__name__}: {exc} (rerun with --debug for the traceback)", 1)

    return wrapper


def _fail(message, code: int):
    if STATE["debug"]:
        traceback.print_exc()
    text = str(message).splitlines()[0] if str(message) else type(message).__name__
    err.print(f"[red]error:[/] {escape(text)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def recipe_path(arg: str) -> Path:
    path = Path(arg)
    shipped = RECIPES_DIR / f"{arg}.yaml"
    return shipped if not path.exists() and shipped.is_file() else path


@app.command()
@handled
def train(
    recipe: RecipeArg,
    overrides: Overrides = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Run directory (default: the recipe's output_dir).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in the output dir from its last checkpoint.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace another run in the output dir.")] = False,
    nproc: Annotated[int, typer.Option("--nproc", min=1, help="Data-parallel processes (launched with torchrun; gloo on CPU, nccl on CUDA).")] = 1,
) -> None:
    """Fine-tune with LoRA as the recipe says; writes config.yaml, metrics.jsonl, checkpoints/, adapter/, summary.json."""
    from .report import RichReporter
    from .run.engine import train as train_one
    from .run.per_user import train_per_user

    loaded = load_recipe(recipe_path(recipe), overrides or [])
    if output is not None:
        loaded.output_dir = str(output)
    if nproc > 1 and "WORLD_SIZE" not in os.environ:
        sys.exit(_launch(loaded, recipe, overrides or [], nproc, resume, force))
    run = train_per_user if loaded.data.user == "all" else train_one
    run(loaded, Path(loaded.output_dir), RichReporter(err), resume=resume, force=force)


def _launch(loaded, recipe: str, overrides: list[str], nproc: int, resume: bool, force: bool) -> int:
    """Check what can be checked here (exit 2 before any worker starts), then rerun this command under torchrun."""
    from .run.distributed import check_parallel_method, launch
    from .run.rundir import check_fresh, check_resume

    run_dir = Path(loaded.output_dir)
    check_resume(run_dir, loaded) if resume else check_fresh(run_dir, force)
    check_parallel_method(loaded.method)
    flags = ["--output", str(run_dir)] + ["--resume"] * resume + ["--force"] * force
    return launch(nproc, ["--debug"] * STATE["debug"] + ["train", str(recipe_path(recipe)), *overrides, *flags])


@app.command("eval")
@handled
def eval_(
    target: Annotated[str, typer.Argument(help="A recipe (evaluates the base model or --adapter) or a run dir (its config.yaml and adapter/).")],
    overrides: Overrides = None,
    adapter: Annotated[Optional[Path], typer.Option("--adapter", help="A PEFT adapter dir to evaluate.")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Where eval.json and predictions.json go (default: the run dir or the recipe's output_dir).")] = None,
) -> None:
    """LaMP-2 accuracy and macro-F1 of a base model, an adapter or a finished run."""
    from .evaluate import run_eval
    from .report import eval_table

    if output is not None:
        check_output_dir(output)
    path = Path(target)
    run_dir = path if path.is_dir() else None
    if run_dir is not None:
        if not (run_dir / "config.yaml").is_file():
            raise BadInput(f"{run_dir}: not a run directory (no config.yaml); give a recipe or a run dir")
        recipe = load_recipe(run_dir / "config.yaml", overrides or [])
        if adapter is None and recipe.data.user != "all":
            adapter = run_dir / "adapter"
            if not adapter.is_dir():
                raise BadInput(f"{run_dir}: the run has no adapter/ yet; finish it with `lcsb train ... --resume`")
    else:
        recipe = load_recipe(recipe_path(target), overrides or [])
    result = run_eval(recipe, output or run_dir or Path(recipe.output_dir), adapter, run_dir)
    out.print(eval_table(result))


@app.command()
@handled
def validate(recipe: RecipeArg, overrides: Overrides = None) -> None:
    """Check a recipe (and overrides) and print it resolved, every default filled in."""
    out.print(dump(load_recipe(recipe_path(recipe), overrides or [])), markup=False, highlight=False, end="")


@app.command()
@handled
def bench(
    recipe: RecipeArg,
    overrides: Overrides = None,
    compare: Annotated[list[str], typer.Option("--compare", help="A method to set against the recipe's: full-backprop, full-backprop+ckpt, freeze, lisa, mezo, hf-trainer, hf-trainer:bf16, lcsb:K. Repeatable.")] = [],  # noqa: B006
    steps: Annotated[int, typer.Option("--steps", min=1, help="Timed steps per method.")] = 8,
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="Untimed steps per method first.")] = 2,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Where bench.json, bench.md and loss_curves.png go (default: OUTPUT_DIR/bench).")] = None,
    evaluate: Annotated[bool, typer.Option("--eval/--no-eval", help="Evaluate each method on the recipe's eval set afterwards.")] = False,
) -> None:
    """Methods side by side on one recipe: interleaved timed steps, one process per method."""
    from .bench.compare import method_names, run_bench
    from .bench.table import bench_rich

    loaded = load_recipe(recipe_path(recipe), overrides or [])
    if not compare:
        raise BadInput("--compare: name at least one method, e.g. --compare full-backprop")
    method_names(loaded, compare)
    result = run_bench(loaded, compare, steps, warmup, output or Path(loaded.output_dir) / "bench", evaluate)
    out.print(bench_rich(result, loaded))


@app.command()
@handled
def export(
    run_dir: Annotated[Path, typer.Argument(help="A finished run directory.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="A new (or empty) directory to write; with "
                                         "--format gguf, a new .gguf file.")],
    merge: Annotated[bool, typer.Option("--merge", help="Write the base model with the adapter merged in.")] = False,
    fmt: Annotated[str, typer.Option("--format", help="Merged model as an HF checkpoint dir (hf) or one GGUF "
                                     "file that llama.cpp loads (gguf).")] = "hf",
    outtype: Annotated[Optional[str], typer.Option("--outtype", help="GGUF matrices: f16 (default) | bf16 | "
                                                   "q8_0; 1-D tensors stay f32.")] = None,
    user: Annotated[Optional[str], typer.Option("--user", help="For a per-user run: whose adapter.")] = None,
) -> None:
    """Write a run's adapter (PEFT format) or, with --merge, a standalone merged model (HF dir or GGUF file)."""
    from .model.export import export_run

    written = export_run(run_dir, output, merge, user, fmt, outtype)
    kind = f"merged {fmt.upper()} model" if merge else "adapter"
    out.print(f"{kind} written to {written}", highlight=False)


@app.command()
@handled
def recipes() -> None:
    """List the shipped recipes."""
    paths = sorted(RECIPES_DIR.glob("*.yaml"))
    width = max((len(path.stem) for path in paths), default=0)
    for path in paths:
        first = path.read_text().splitlines()[0] if path.read_text() else ""
        out.print(f"[bold]{path.stem:<{width}}[/] {first.lstrip('# ')}  ({path})", highlight=False)


if __name__ == "__main__":
    sys.exit(app())
