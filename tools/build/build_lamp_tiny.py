"""Build the built-in pretrained base `lamp-tiny` (configs/models/lamp-tiny/) from the synthetic corpus.

Deterministic: a fixed corpus seed, a seeded init and data order, one thread. Full-parameter causal-LM
pretraining with AdamW + cosine; weights are saved in bf16 with the tokenizer and a model card.
    python tools/build/build_lamp_tiny.py                    # the shipped build
    python tools/build/build_lamp_tiny.py --steps 3 --out /tmp/x   # a smoke run
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import yaml
from synthetic import pretrain_documents
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

from lcsb_cli.model.load import PRESET_DIR, TOKENIZER_DIR

SHAPE = PRESET_DIR / "lamp-tiny.yaml"


def packed_sequences(tokenizer, docs: list[str], length: int) -> torch.Tensor:
    ids: list[int] = []
    for doc in docs:
        ids += tokenizer(doc)["input_ids"] + [tokenizer.eos_token_id]
    usable = len(ids) // length * length
    return torch.tensor(ids[:usable]).view(-1, length)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=PRESET_DIR / "lamp-tiny")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--docs", type=int, default=12000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    spec = yaml.safe_load(SHAPE.read_text())
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR / spec["tokenizer"])
    data = packed_sequences(tokenizer, pretrain_documents(args.seed, args.docs), args.length)
    special = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(spec["architecture"], **spec["config"], **special))
    # so plain `generate` stops at the end of an answer
    model.generation_config.update(**special)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    schedule = get_cosine_schedule_with_warmup(optimizer, max(args.steps // 20, 1), args.steps)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(args.seed))
    start, losses = time.time(), []
    for step in range(args.steps):
        rows = order[(torch.arange(args.batch) + step * args.batch) % len(data)]
        batch = data[rows]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f} ({time.time() - start:.0f}s)", flush=True)
    final = sum(losses[-20:]) / len(losses[-20:])
    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    (args.out / "MODEL_CARD.md").write_text(model_card(args, spec, data, final, time.time() - start))


def model_card(args, spec, data: torch.Tensor, final_loss: float, seconds: float) -> str:
    params = sum(math.prod(v) for v in _shapes(spec))
    return f"""# lamp-tiny

A small Qwen2-style causal LM pretrained by `tools/build/build_lamp_tiny.py` on the project's synthetic movie
corpus (`pretrain_documents` in `tools/build/synthetic.py`: runs of `the tag for the movie: "..." is "..."`
statements by synthetic users with their own tag habits, LaMP-2 questions answered with a user's tag, and plain
movie blurbs). Its users are not the sample's, and it never saw a question beside its asker's profile: it knows
a population's cue -> tag habits, not any one user's. Weights are bf16 safetensors.

- shape: {spec["config"]}
- parameters: about {params / 1e6:.1f}M
- corpus: {args.docs} documents (seed {args.seed}), packed into {len(data)} sequences of {args.length} tokens
- training: {args.steps} steps x {args.batch} sequences, AdamW lr {args.lr} (cosine, 5% warmup), wd 0.1,
  bf16 autocast, 1 thread, {seconds:.0f}s on this project's 2-core CPU machine
- final loss (mean of the last 20 steps): {final_loss:.4f}
- command: `python tools/build/build_lamp_tiny.py --steps {args.steps} --batch {args.batch} --length {args.length} \
--lr {args.lr} --docs {args.docs} --seed {args.seed}`
"""


def _shapes(spec):
    c = spec["config"]
    h, i, layers, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    per_layer = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]
    return [(v, h)] + per_layer * layers


if __name__ == "__main__":
    main()
