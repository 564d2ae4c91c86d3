"""The `lcsb` verbs: each parses, loads the recipe, calls one library function and prints."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from ..errors import BadInput
from ..paths import RECIPES_DIR, recipe_file
from ..recipe import dump, load_recipe, with_autocast_chosen
from ..recipe.parse import explain as explain_keys
from ..rundir import check_output_dir, resolve_target
from .app import STATE, Overrides, RecipeArg, Temperature, UserOption, app, err, flag, handled, out


@app.command()
@handled
def train(
    recipe: RecipeArg,
    overrides: Overrides = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Run directory (default: the recipe's output_dir).")
    ] = None,
    resume: Annotated[
        bool, flag("--resume", help="Continue the run in the output dir from its last checkpoint.")
    ] = False,
    force: Annotated[bool, flag("--force", help="Replace another run in the output dir.")] = False,
    nproc: Annotated[
        int,
        typer.Option(
            "--nproc", min=1, help="Data-parallel processes on this node (torchrun; gloo on CPU, nccl on CUDA)."
        ),
    ] = 1,
    nnodes: Annotated[int, typer.Option("--nnodes", min=1, help="Nodes, each running this command.")] = 1,
    node_rank: Annotated[int | None, typer.Option("--node-rank", min=0, help="Node rank (static rdzv only).")] = None,
    rdzv_endpoint: Annotated[str | None, typer.Option("--rdzv-endpoint", help="HOST:PORT all nodes join.")] = None,
    rdzv_id: Annotated[str | None, typer.Option("--rdzv-id", help="The rendezvous' id (torchrun's).")] = None,
    rdzv_backend: Annotated[str | None, typer.Option("--rdzv-backend", help="c10d (default) | static.")] = None,
) -> None:
    """Fine-tune with LoRA as the recipe says; writes config.yaml, metrics.jsonl, checkpoints/, adapter/, summary.json.

    Ctrl-C (SIGINT) checkpoints and exits 130; SIGTERM, the overnight window's end and max_minutes checkpoint and
    exit 0, as a scheduler expects.

    Examples: `lcsb train lamp2` · `lcsb train my.yaml train.max_steps=200 lcsb.blocks=2 -o runs/k2` ·
    `lcsb train my.yaml -o runs/k2 --resume` · on each of 2 nodes: `lcsb train my.yaml --nproc 4 --nnodes 2
    --rdzv-endpoint node0:29400 -o /shared/runs/k2`. Recipe keys: `lcsb validate RECIPE` prints them all, resolved."""
    launching = "WORLD_SIZE" not in os.environ and (nproc > 1 or nnodes > 1 or rdzv_endpoint is not None)
    if launching:
        # read as torch loads; torchrun's agent runs here: c10d's warnings (with frame dumps) would bury the errors
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from ..display import RichDisplay
    from ..run.distributed import Nodes
    from ..run.entry import train as train_run

    loaded, autocast = with_autocast_chosen(load_recipe(recipe_file(recipe), overrides or []))
    if output is not None:
        loaded.output_dir = str(output)
    if launching:
        nodes = Nodes(nnodes, node_rank, rdzv_endpoint, rdzv_id, rdzv_backend)
        sys.exit(_launch(loaded, recipe, overrides or [], nproc, nodes, resume, force))
    summary = train_run(loaded, Path(loaded.output_dir), RichDisplay(err, [autocast]), resume=resume, force=force)
    # checkpointed, yet `lcsb train ... && next` must not run on
    if summary.get("stopped") == "SIGINT":
        err.print(f"interrupted: checkpointed at step {summary.get('steps')}; continue with --resume", highlight=False)
        sys.exit(130)


def _launch(loaded, recipe: str, overrides: list[str], nproc: int, nodes, resume: bool, force: bool) -> int:
    """Check what can be checked here (exit 2 before any worker starts), then rerun this command under torchrun."""
    from ..run.distributed import check_parallel_method, launch
    from ..rundir import check_fresh, check_resume

    run_dir = Path(loaded.output_dir)
    check_resume(run_dir, loaded) if resume else check_fresh(run_dir, force)
    check_parallel_method(loaded.method)
    flags = ["--output", str(run_dir)] + ["--resume"] * resume + ["--force"] * force
    command = ["--debug"] * STATE["debug"] + ["train", str(recipe_file(recipe)), *overrides, *flags]
    return launch(nproc, command, nodes)


@app.command("eval")
@handled
def eval_(
    target: Annotated[
        str,
        typer.Argument(
            help="A recipe (evaluates the base model or --adapter) or a run dir (its config.yaml and adapter/)."
        ),
    ],
    overrides: Overrides = None,
    adapter: Annotated[
        Path | None,
        typer.Option("--adapter", help="A PEFT adapter dir, or an adapter GGUF from lcsb export, to evaluate."),
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="Where eval.json and predictions.json go (default: the run dir or the recipe's output_dir).",
        ),
    ] = None,
) -> None:
    """Held-out metrics (loss, and accuracy/macro-F1 or exact match/ROUGE as the format has) of a base model, an
    adapter or a finished run.

    Examples: `lcsb eval lamp2` (the base) · `lcsb eval runs/lamp2` (the run's adapter) ·
    `lcsb eval lamp2 --adapter DIR -o runs/check`. Recipe keys: `lcsb validate RECIPE` prints them all, resolved."""
    from ..display import Phases, eval_table
    from ..evaluate import run_eval

    if output is not None:
        check_output_dir(output)
    recipe, adapter, run_dir = resolve_target(target, overrides or [], adapter)
    result = run_eval(recipe, output or run_dir or Path(recipe.output_dir), adapter, run_dir, Phases(err))
    out.print(eval_table(result))


@app.command()
@handled
def generate(
    target: Annotated[
        str,
        typer.Argument(
            help="A recipe (the base model, or --adapter), a run dir (its adapter/) or "
            "a merged export dir (`lcsb export RUN --merge`)."
        ),
    ],
    overrides: Overrides = None,
    *,
    adapter: Annotated[
        Path | None,
        typer.Option("--adapter", help="A PEFT adapter dir, or an adapter GGUF from lcsb export, to generate with."),
    ] = None,
    user: UserOption = None,
    prompt: Annotated[
        str | None, typer.Option("--prompt", help="The text to continue (with --chat: the user's message).")
    ] = None,
    file: Annotated[
        Path | None,
        typer.Option(
            "--file",
            help='JSONL of {"prompt": TEXT} lines, or with --chat {"messages": [...]} lines; one generation per line.',
        ),
    ] = None,
    chat: Annotated[bool, flag("--chat", help="Wrap each prompt in the tokenizer's chat template.")] = False,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="New tokens at most.")] = 128,
    temperature: Temperature = 0.0,
    seed: Annotated[int, typer.Option("--seed", help="The sampling seed (temperature above 0).")] = 0,
    stop: Annotated[
        list[str] | None,
        typer.Option(
            "--stop",
            metavar="TEXT",
            help="End a "
            "generation before this text (\\\\n: a newline; repeat for "
            "several); default: the recipe's eval.stop.",
        ),
    ] = None,
) -> None:
    """Decode with the KV cache and stream each generation to the terminal.

    Examples: `lcsb generate runs/chat --chat --prompt "Hi"` · `lcsb generate runs/lamp2 --user u1 --file q.jsonl` ·
    `lcsb generate merged/ --prompt "Once" --temperature 0.8 --stop "\\n"`.
    Recipe keys: `lcsb validate RECIPE` prints them all, resolved."""
    from ..generate import Sampling, read_inputs, run_generate

    if (prompt is None) == (file is None):
        raise BadInput("give exactly one of --prompt TEXT and --file JSONL")
    recipe, adapter, run_dir = resolve_target(target, overrides or [], adapter, user, model_dir_ok=True)
    if run_dir is not None and adapter is None:
        raise BadInput(f"{run_dir}: a per-user run has one adapter per user; pass --user ID")
    inputs = [prompt] if file is None else read_inputs(file, chat)
    stops = recipe.eval.stop if stop is None else [s.replace("\\n", "\n") for s in stop]
    run_generate(recipe, adapter, inputs, chat, Sampling(max_new_tokens, temperature, seed, tuple(stops)))


@app.command()
@handled
def chat(
    target: Annotated[
        str,
        typer.Argument(
            help="A run dir (its adapter/), a model dir (e.g. `lcsb export RUN --merge`), a built-in preset or "
            ".gguf file (with --adapter), or a recipe."
        ),
    ],
    overrides: Overrides = None,
    *,
    adapter: Annotated[
        Path | None,
        typer.Option("--adapter", help="A PEFT adapter dir, or an adapter GGUF from lcsb export, to chat with."),
    ] = None,
    user: UserOption = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="New tokens per reply at most.")] = 256,
    temperature: Temperature = 0.0,
    seed: Annotated[int, typer.Option("--seed", help="The sampling seed (turn n samples with SEED+n).")] = 0,
    stop: Annotated[
        list[str] | None,
        typer.Option(
            "--stop", metavar="TEXT", help="Also end a reply before this text (\\\\n: a newline; repeatable)."
        ),
    ] = None,
    transcript: Annotated[
        Path | None,
        typer.Option("--transcript", help="Append one JSON line per turn: the prompt the model saw, its reply."),
    ] = None,
) -> None:
    """Talk with a model or an adapter: a multi-turn REPL over one KV cache, replies streamed as they come.

    Each turn feeds the model only the tokens its cache does not hold yet (the new user turn and the template's
    glue). The base's chat template is used, or lcsb's plain chat layout when it has none. Commands: `/reset`
    clears the conversation, `/system TEXT` sets the system message (and starts over), `/exit` or Ctrl-D leaves;
    Ctrl-C stops the reply in progress. Without a TTY, each stdin line is one user turn and stdout holds the
    replies, one per turn.

    Examples: `lcsb chat runs/chat-smollm2` · `lcsb chat runs/lamp2-smollm2 --user u1` ·
    `lcsb chat smollm2-135m --adapter runs/chat/adapter --temperature 0.7` ·
    `printf 'Hi\\nMore\\n' | lcsb chat merged/`. Recipe keys: `lcsb validate RECIPE` prints them all, resolved."""
    from ..chat import chat_target, run_chat
    from ..generate import Sampling

    recipe, adapter = chat_target(target, overrides or [], adapter, user)
    stops = tuple(s.replace("\\n", "\n") for s in stop or [])
    run_chat(recipe, adapter, Sampling(max_new_tokens, temperature, seed, stops), transcript)


@app.command()
@handled
def validate(
    recipe: RecipeArg,
    overrides: Overrides = None,
    explain: Annotated[
        bool, flag("--explain", help="Every key with its value, its allowed values or minimum, and what it does.")
    ] = False,
) -> None:
    """Check a recipe (and overrides) and print it resolved, every default filled in: the list of recipe keys.

    Examples: `lcsb validate lamp2` · `lcsb validate my.yaml train.lr=1e-4 quantization=nf4` ·
    `lcsb validate lamp2 --explain`."""
    loaded = load_recipe(recipe_file(recipe), overrides or [])
    out.print(explain_keys(loaded) if explain else dump(loaded), markup=False, highlight=False, end="", soft_wrap=True)


@app.command()
@handled
def bench(
    recipe: RecipeArg,
    overrides: Overrides = None,
    compare: Annotated[
        list[str],
        typer.Option(
            "--compare",
            help="A method to set against the recipe's: full-backprop, full-backprop+ckpt, freeze, lisa, mezo, "
            "hf-trainer, hf-trainer:bf16, lcsb:K (the recipe's upper path), lcsb:K:suffix, lcsb:K:exact, "
            "lcsb:K:identity; METHOD@KEY=VALUE[,KEY=VALUE] runs it with recipe overrides. Repeatable.",
        ),
    ] = [],  # noqa: B006
    steps: Annotated[int, typer.Option("--steps", min=1, help="Timed steps per method.")] = 8,
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="Untimed steps per method first.")] = 2,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output", "-o", help="Where bench.json, bench.md and loss_curves.png go (default: OUTPUT_DIR/bench)."
        ),
    ] = None,
    evaluate: Annotated[
        bool,
        flag(
            "--eval/--no-eval",
            help="Evaluate each method on the recipe's eval set afterwards "
            "(its adapter is kept under OUTPUT/adapters/).",
        ),
    ] = False,
    seeds: Annotated[
        int,
        typer.Option("--seeds", min=1, help="Run every method with this many seeds (train.seed, +1, ...); mean ± std."),
    ] = 1,
    budget: Annotated[
        str,
        typer.Option(
            "--budget",
            help="equal-steps: every method takes --steps; "
            "equal-time: each trains as long as full backprop's --steps take.",
        ),
    ] = "equal-steps",
) -> None:
    """Methods side by side on one recipe: interleaved timed steps, one process per method.

    Examples: `lcsb bench lamp2 --compare full-backprop` · `lcsb bench my.yaml --compare full-backprop
    --compare lcsb:4:exact --seeds 3 --budget equal-time --eval`.
    Recipe keys: `lcsb validate RECIPE` prints them all, resolved."""
    from ..bench.compare import method_names, run_bench
    from ..bench.table import bench_rich
    from ..display import Phases

    loaded, autocast = with_autocast_chosen(load_recipe(recipe_file(recipe), overrides or []))
    if not compare:
        raise BadInput("--compare: name at least one method, e.g. --compare full-backprop")
    method_names(loaded, compare, budget)
    result = run_bench(
        loaded,
        compare,
        steps,
        warmup,
        output or Path(loaded.output_dir) / "bench",
        evaluate,
        Phases(err).bench_step,
        seeds=seeds,
        budget=budget,
    )
    if autocast:
        err.print(autocast, highlight=False, soft_wrap=True)
    out.print(bench_rich(result, loaded))


@app.command()
@handled
def export(
    run_dir: Annotated[Path, typer.Argument(help="A finished run directory.")],
    output: Annotated[
        Path,
        typer.Option(
            "--output",
            "-o",
            help="A new (or empty) directory to write; with --format gguf, a new .gguf file (an adapter GGUF of a "
            "per-user run without --user: a new or empty directory).",
        ),
    ],
    merge: Annotated[bool, flag("--merge", help="Write the base model with the adapter merged in.")] = False,
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            help="hf: the PEFT adapter, or with --merge an HF checkpoint dir. gguf: llama.cpp's LoRA adapter GGUF, "
            "or with --merge one merged GGUF file.",
        ),
    ] = "hf",
    outtype: Annotated[
        str | None,
        typer.Option(
            "--outtype",
            help="GGUF matrices: merged f16 (default) | bf16 | q8_0 (1-D tensors stay f32); adapter f32 (default) "
            "| f16.",
        ),
    ] = None,
    user: UserOption = None,
    modelfile: Annotated[
        bool,
        flag(
            "--modelfile",
            help="With --merge --format gguf: also an Ollama Modelfile OUT.Modelfile beside OUT.gguf, FROM that file "
            "(Ollama 0.34.1 and later take no LoRA adapter; serve an adapter GGUF with llama-server --lora).",
        ),
    ] = False,
) -> None:
    """Write a run's adapter (PEFT format or llama.cpp's adapter GGUF) or, with --merge, a standalone merged model.

    Adapter GGUF (--format gguf without --merge): a run or `--user ID` of a per-user run gives one file, --output; a
    per-user run without --user gives --output as a new or empty directory holding USER.gguf for every user whose
    adapter is finished; `llama-server -m BASE.gguf --lora OUT.gguf` serves it. With --merge --format gguf,
    --modelfile writes OUT.Modelfile beside OUT.gguf for `ollama create NAME -f OUT.Modelfile`: FROM the merged file,
    at the --outtype it runs in, and no TEMPLATE line (Ollama reads the file's chat template, the base's, itself).

    Examples: `lcsb export runs/lamp2 -o adapter/` · `lcsb export runs/chat --merge -o merged/` ·
    `lcsb export runs/chat --format gguf -o chat.gguf` · `lcsb export runs/chat --merge --format gguf --outtype q8_0
    -o chat.gguf --modelfile` · `lcsb export runs/lamp2-smollm2 --format gguf -o users/`."""
    from ..export import export_run

    written = export_run(run_dir, output, merge, user, fmt, outtype, modelfile)
    if merge:
        kind = f"merged {fmt.upper()} model"
    elif fmt == "gguf":
        kind = "LoRA adapter GGUFs (one per user)" if written.is_dir() else "LoRA adapter GGUF"
    else:
        kind = "adapter"
    extra = " with an Ollama Modelfile" if modelfile else ""
    out.print(f"{kind}{extra} written to {written}", highlight=False, soft_wrap=True)


@app.command()
@handled
def recipes() -> None:
    """List the shipped recipes (use a name wherever a recipe file goes).

    Example: `lcsb recipes`, then `lcsb validate lamp2`."""
    paths = sorted(RECIPES_DIR.glob("*.yaml"))
    width = max((len(path.stem) for path in paths), default=0)
    for path in paths:
        first = path.read_text().splitlines()[0] if path.read_text() else ""
        out.print(f"[bold]{path.stem:<{width}}[/] {first.lstrip('# ')}  ({path})", highlight=False, soft_wrap=True)
