"""A strong adapter on a quantized base: how far llama.cpp's effect of the adapter GGUF is from lcsb's, and why
(issue 47's item 7; figures in docs/RESULTS.md).

    lcsb train recipes/lamp2-smollm2.yaml quantization=gguf data.user=null train.max_steps=12 train.lr=3e-3 \\
        train.save_every=0 -o runs/strong
    lcsb export runs/strong --format gguf -o strong.gguf
    python scripts/adapter_fidelity.py measure runs/strong strong.gguf [--prompts text]
    python scripts/adapter_fidelity.py train-q8 runs/strong-q8   # the same run, trained through llama.cpp's rounding

`measure`, on the first 4 held-out LaMP-2 prompts (or tests/test_gguf_adapter.py's 3 text prompts), every position's
logits centred: llama.cpp (lcsb_cli/model/llama_cpp.py) on the base's GGUF file and on that file dequantized to F32,
each with and without the adapter GGUF (also with its alpha scaled by 0.25 and 0.5), against lcsb's packed base with
and without the adapter, with exact activations and with every quantized product's input rounded as llama.cpp's CPU
dot products round it (8 bits per block of 32, scale max|x| / 127: the packed projections and the tied head).
`train-q8` trains `lcsb train`'s run above with that rounding in the forward of every packed product (the gradient
is the exact one, straight through).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import gguf
import numpy as np
import torch

from lcsb_cli.model import packed
from lcsb_cli.model.llama_cpp import LlamaCpp

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "lamp2-smollm2.yaml"
RUN = ["quantization=gguf", "data.user=null", "train.max_steps=12", "train.lr=3e-3", "train.save_every=0"]
TEXT = [
    "The rusty hayfinch is a small bird of the hay meadows. In the valley it occurs in",
    "Markets in Upper Tessel are held on Tuesdays. The largest is at Skelgill, where",
    "def add(a, b):\n    return a + b\n\n# The capital of France is Paris, and",
]
SCALES = (0.25, 0.5, 1.0)


def q8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x rounded as llama.cpp quantizes activations for its quantized dot products (Q8_0 / Q8_1)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    return (torch.round(blocks / torch.where(scale == 0, 1, scale)) * scale).reshape(x.shape).to(x.dtype)


def rewritten(source: Path, target: Path, alpha_scale: float = 1.0, dequantize: bool = False) -> Path:
    """`source` with its adapter alpha scaled, or with every tensor dequantized to F32."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "general.architecture")) or (dequantize and key == "general.file_type"):
            continue
        value = field.contents()
        if key == "adapter.lora.alpha":
            value *= alpha_scale
        writer.add_key_value(key, value, field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None)
    if dequantize:
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for tensor in reader.tensors:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, data if dequantize else data.astype(tensor.data.dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def llama_cpp(base: Path, lora: Path | None, prompts: list[list[int]]) -> torch.Tensor:
    with LlamaCpp(base, lora, n_ctx=1024) as llm:
        return centred(torch.cat([torch.from_numpy(llm.logits(ids)) for ids in prompts]))


def lcsb(model, prompts: list[list[int]], q8: bool, scale: float | None) -> torch.Tensor:
    """lcsb's logits: the adapter at `scale` (None: off), activations of quantized products rounded when `q8`."""
    exact, hooks = packed.PackedLinear.forward, []
    if q8:
        packed.PackedLinear.forward = lambda self, x: exact(self, q8_blocks(x))
        head = model.get_output_embeddings()
        hooks.append(head.register_forward_pre_hook(lambda _, args: (q8_blocks(args[0]),)))
    loras = [m for m in model.modules() if isinstance(getattr(m, "scaling", None), dict)]
    saved = [dict(m.scaling) for m in loras]
    for m in loras:
        m.scaling["default"] *= scale or 1.0
    try:
        with torch.no_grad(), model.disable_adapter() if scale is None else contextlib.nullcontext():
            return centred(torch.cat([model(input_ids=torch.tensor([ids])).logits[0].float() for ids in prompts]))
    finally:
        packed.PackedLinear.forward = exact
        for hook in hooks:
            hook.remove()
        for m, kept in zip(loras, saved):
            m.scaling.update(kept)


def centred(logits: torch.Tensor) -> torch.Tensor:
    return logits - logits.mean(-1, keepdim=True)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.flatten().double(), b.flatten().double()
    return round((a @ b / (a.norm() * b.norm())).item(), 4)


def rms(x: torch.Tensor) -> float:
    return round(x.pow(2).mean().sqrt().item(), 4)


def distance(a: torch.Tensor, reference: torch.Tensor) -> dict:
    """max |a - reference| over the reference's largest |logit|, and RMS."""
    return {
        "max_of_top": round(((a - reference).abs().max() / reference.abs().max()).item(), 4),
        "rms": rms(a - reference),
    }


def measure(run: Path, adapter: Path, which: str) -> dict:
    from lcsb_cli.data import load_task
    from lcsb_cli.evaluate.labels import prompt_ids
    from lcsb_cli.model.load import gguf_source, load_model
    from lcsb_cli.recipe import load_recipe

    recipe = load_recipe(run / "config.yaml", ["quantization=gguf"])
    loaded = load_model(recipe, torch.device("cpu"), run / "adapter")
    model, tokenizer = loaded.model.eval(), loaded.tokenizer
    if which == "lamp2":
        prompts = [prompt_ids(tokenizer, q, recipe) for q in load_task(recipe, tokenizer).held_out[:4]]
    else:
        prompts = [tokenizer(text).input_ids for text in TEXT]
    base = gguf_source(recipe.model.name)
    work = adapter.parent / f"{adapter.stem}-fidelity"
    work.mkdir(exist_ok=True)
    f32 = rewritten(base, work / "f32.gguf", dequantize=True)
    ours = {(q8, s): lcsb(model, prompts, q8, s) for q8 in (False, True) for s in (None, *SCALES)}
    cpp = {"f32": llama_cpp(f32, None, prompts), "f32+": llama_cpp(f32, adapter, prompts)}
    cpp["base"] = llama_cpp(base, None, prompts)
    for s in SCALES:
        lora = adapter if s == 1.0 else rewritten(adapter, work / f"alpha-x{s}.gguf", alpha_scale=s)
        cpp[s] = llama_cpp(base, lora, prompts)
    effect = ours[False, 1.0] - ours[False, None]
    error = {"without": cpp["base"] - ours[False, None], "with": cpp[1.0] - ours[False, 1.0]}
    rounding = {"without": ours[True, None] - ours[False, None], "with": ours[True, 1.0] - ours[False, 1.0]}
    return {
        "prompts": which,
        "positions": len(effect),
        "adapter's move of the top logit, of its size": round(
            (effect.abs().max() / ours[False, None].abs().max()).item(), 3
        ),
        "effect rms / logit rms": [rms(effect), rms(ours[False, None])],
        "F32 file: llama.cpp vs lcsb with the adapter": distance(cpp["f32+"], ours[False, 1.0]),
        "F32 file: effect cosine": cosine(cpp["f32+"] - cpp["f32"], effect),
        "quantized file: llama.cpp vs lcsb without / with the adapter": [
            distance(cpp["base"], ours[False, None]),
            distance(cpp[1.0], ours[False, 1.0]),
        ],
        "quantized file: effect cosine at alpha x 0.25, 0.5, 1": [
            cosine(cpp[s] - cpp["base"], ours[False, s] - ours[False, None]) for s in SCALES
        ],
        "quantized file: effect error rms at alpha x 0.25, 0.5, 1": [
            rms(cpp[s] - cpp["base"] - ours[False, s] + ours[False, None]) for s in SCALES
        ],
        "llama.cpp's quantized file vs its F32 file, without / with": [
            distance(cpp["base"], cpp["f32"]),
            distance(cpp[1.0], cpp["f32+"]),
        ],
        "lcsb's own 8-bit rounding vs exact, without / with": [
            distance(ours[True, None], ours[False, None]),
            distance(ours[True, 1.0], ours[False, 1.0]),
        ],
        "lcsb with the rounding vs llama.cpp, without / with": [
            distance(cpp["base"], ours[True, None]),
            distance(cpp[1.0], ours[True, 1.0]),
        ],
        "cosine of llama.cpp's error without and with the adapter": cosine(error["without"], error["with"]),
        "cosine of the rounding's shift and llama.cpp's error, without / with": [
            cosine(rounding[k], error[k]) for k in ("without", "with")
        ],
    }


def train_q8(out: Path, overrides: list[str]) -> None:
    from lcsb_cli.cli import app

    exact = packed.PackedLinear.forward
    packed.PackedLinear.forward = lambda self, x: exact(self, x + (q8_blocks(x) - x).detach())
    app(["train", str(RECIPE), *RUN, *overrides, "-o", str(out)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)
    one = verbs.add_parser("measure")
    one.add_argument("run", type=Path)
    one.add_argument("adapter", type=Path)
    one.add_argument("--prompts", choices=("lamp2", "text"), default="lamp2")
    two = verbs.add_parser("train-q8")
    two.add_argument("out", type=Path)
    two.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.verb == "train-q8":
        train_q8(args.out, args.overrides)
    else:
        json.dump(measure(args.run, args.adapter, args.prompts), sys.stdout, indent=1)
        print()


if __name__ == "__main__":
    main()
