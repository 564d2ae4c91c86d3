"""The Typer app every verb hangs on: one-line errors with their exit codes, the global flags, shared arguments."""

from __future__ import annotations

import functools
import sys
import traceback
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from ..errors import LcsbError
from ..runtime import set_verbose

# click's UsageError (typer may bundle its own click)
USAGE_ERROR = typer.BadParameter.__bases__[0]


class OneLineErrors(typer.Typer):
    """Usage errors (an unknown flag, a missing option) get one line and exit 2, like every other bad input."""

    def __call__(self, *args, **kwargs):
        if not kwargs.pop("standalone_mode", True):
            return super().__call__(*args, standalone_mode=False, **kwargs)
        try:
            code = super().__call__(*args, standalone_mode=False, **kwargs)
        except USAGE_ERROR as exc:
            # plain `lcsb`: the help text, as asked
            if type(exc).__name__ == "NoArgsIsHelpError":
                exc.show()
                sys.exit(exc.exit_code)
            where = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx else ""
            err.print(f"[red]error:[/] {escape(exc.format_message())}{where}", highlight=False, soft_wrap=True)
            sys.exit(2)
        except typer.Abort:
            err.print("aborted", highlight=False)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


app = OneLineErrors(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},
    help="LoRA fine-tuning with layer-cyclic selective backprop. Every verb's -h has examples; "
    "`lcsb validate RECIPE` prints every recipe key, resolved.",
)
err = Console(stderr=True)
out = Console()
STATE = {"debug": False}


def flag(*names: str, help: str):
    """A boolean switch, shown as a flag in help rather than `<bool>`."""
    return typer.Option(*names, help=help, metavar="")


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        out.print(f"lcsb {version('lcsb')}", highlight=False)
        raise typer.Exit()


RecipeArg = Annotated[
    str, typer.Argument(help="A recipe YAML file, or the name of a shipped recipe (see `lcsb recipes`).")
]
Overrides = Annotated[
    list[str] | None, typer.Argument(help="Dotted KEY=VALUE overrides, e.g. train.max_steps=20 lcsb.blocks=2.")
]
UserOption = Annotated[str | None, typer.Option("--user", help="For a per-user run: whose adapter.")]
Temperature = Annotated[
    float, typer.Option("--temperature", min=0.0, help="0: greedy; above 0: sampling at this temperature.")
]


@app.callback()
def main(
    debug: Annotated[bool, flag("--debug", help="Show the traceback of any error.")] = False,
    verbose: Annotated[
        bool,
        flag(
            "--verbose",
            "-v",
            help="Also show the libraries' log lines and warnings on stderr (they always go to the run's lcsb.log).",
        ),
    ] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version", help="Print the version and exit.", metavar="", is_eager=True, callback=_print_version
        ),
    ] = False,
) -> None:
    STATE["debug"] = debug
    set_verbose(verbose)


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
        except Exception as exc:
            _fail(f"{type(exc).__name__}: {exc} (rerun with --debug for the traceback)", 1)

    return wrapper


def _fail(message, code: int):
    if STATE["debug"]:
        traceback.print_exc()
    text = str(message).splitlines()[0] if str(message) else type(message).__name__
    err.print(f"[red]error:[/] {escape(text)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)
