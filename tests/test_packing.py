"""data.packing: documents packed greedily in order, positions restarting, attention kept inside each document, the
same per-document losses and gradients as unpacked, the loss masks kept, every method and npu-sim, exact resume."""

import itertools
import math
import shutil

import pytest
import torch
from helpers import LAMP2, REPO, adapter_tensors, assert_same_tensors, model_and_first_batch, run_train

from lcsb_cli.data import build_train_batches
from lcsb_cli.data.batching import collate
from lcsb_cli.data.lamp2 import bos_ids
from lcsb_cli.data.lm import load_lm_split
from lcsb_cli.data.packing import documents, pack_rows
from lcsb_cli.errors import BadInput
from lcsb_cli.model.load import load_model, lora_parameters
from lcsb_cli.model.losses import causal_lm_loss, model_inputs
from lcsb_cli.recipe import load_recipe
from lcsb_cli.rundir import read_metrics

DATA = REPO / "recipes" / "data"
LABELS_OFF = ["data.train_labels=null", "data.eval_labels=null"]
QA = [
    "data.format=completion",
    f"data.train={DATA / 'qa' / 'train.jsonl'}",
    f"data.eval={DATA / 'qa' / 'eval.jsonl'}",
    *LABELS_OFF,
    "data.max_length=128",
    "data.packing=true",
]


@pytest.fixture(scope="module")
def loaded():
    """The tiny model, LoRA B seeded so that the adapters act and get gradients."""
    model, _ = model_and_first_batch(*QA, for_gradients=True)
    return model


def split(tokenizer, fmt: str, path, max_length: int, n: int) -> list[dict]:
    return load_lm_split(str(path), fmt, tokenizer, max_length, "error").rows[:n]


def rows_of(lengths) -> list[dict]:
    """Rows whose tokens are 100*k + i and every token a target."""
    return [
        {"input_ids": [100 * k + i for i in range(n)], "labels": [100 * k + i for i in range(n)]} for k, n in lengths
    ]


def test_packing_is_greedy_in_order_cuts_only_an_overlong_document_and_restarts_positions():
    packed = pack_rows(rows_of([(1, 3), (2, 4), (3, 2), (4, 10), (5, 1), (6, 5)]), max_length=8)
    assert [row["input_ids"] for row in packed] == [
        [100, 101, 102, 200, 201, 202, 203],
        [300, 301],
        [400, 401, 402, 403, 404, 405, 406, 407],
        [408, 409, 600, 601, 602, 603, 604],
    ]
    # document 5 (one token) has nothing to predict once its first token is not a target
    assert packed[0]["position_ids"] == [0, 1, 2, 0, 1, 2, 3]
    assert packed[3]["position_ids"] == [0, 1, 0, 1, 2, 3, 4]
    assert packed[0]["labels"] == [-100, 101, 102, -100, 201, 202, 203]
    assert packed[3]["labels"] == [-100, 409, -100, 601, 602, 603, 604]


def test_text_windows_give_back_their_documents_and_a_held_out_window_cuts_one(tmp_path, loaded):
    tokenizer = loaded.tokenizer
    texts = ["First document, still the first one here.", "Second one.", "Third, a longer one than the second."]
    (tmp_path / "t.txt").write_text("\n\n".join(texts) + "\n")
    windows = load_lm_split(str(tmp_path / "t.txt"), "text", tokenizer, 8, "error").rows
    eos = [tokenizer.eos_token_id]
    docs = [bos_ids(tokenizer) + tokenizer(t, add_special_tokens=False)["input_ids"] + eos for t in texts]
    assert [d["input_ids"] for d in documents(windows)] == docs
    assert all(d["labels"] == d["input_ids"] for d in documents(windows))
    # without window 1, the document it holds a piece of comes back in two
    kept = [w for i, w in enumerate(windows) if i != 1]
    stream = [t for w in kept for t in w["input_ids"]]
    assert [t for d in documents(kept) for t in d["input_ids"]] == stream
    assert len(documents(kept)) == len(docs) + 1


@pytest.mark.parametrize(
    "fmt, path, max_length",
    [("completion", DATA / "qa" / "train.jsonl", 128), ("chat", DATA / "chat" / "train.jsonl", 192)],
)
def test_packed_completion_and_chat_keep_their_loss_masks(loaded, fmt, path, max_length):
    rows = split(loaded.tokenizer, fmt, path, max_length, 40)
    packed = pack_rows(rows, max_length)
    assert len(packed) < len(rows) and all(len(row["input_ids"]) <= max_length for row in packed)
    unpacked = [piece for row in packed for piece in _documents_of(row)]
    assert [p["input_ids"] for p in unpacked] == [r["input_ids"] for r in rows]
    # the first token of each is a prompt token already: the masks are the rows' own
    assert [p["labels"] for p in unpacked] == [r["labels"] for r in rows]


def _documents_of(row: dict) -> list[dict]:
    starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["position_ids"])]
    return [{k: row[k][a:b] for k in ("input_ids", "labels")} for a, b in itertools.pairwise(starts)]


def mixed_documents(tokenizer) -> list[dict]:
    """Answers, conversations and paragraphs, a paragraph after an answer so that some follow another document."""
    qa = split(tokenizer, "completion", DATA / "qa" / "train.jsonl", 256, 5)
    chat = split(tokenizer, "chat", DATA / "chat" / "train.jsonl", 192, 4)
    text = documents(split(tokenizer, "text", DATA / "text" / "eval.txt", 256, 3))[:4]
    docs = [d for pair in zip(qa, text) for d in pair] + qa[len(text) :] + chat
    return [{k: d[k] for k in ("input_ids", "labels")} for d in docs]


def test_a_packed_batch_gives_each_documents_loss_and_gradient_unpacked(loaded):
    model, pad = loaded.model, loaded.tokenizer.pad_token_id
    docs = mixed_documents(loaded.tokenizer)
    packed = pack_rows(docs, 256)
    assert len(packed) >= 3 and sum(len(_documents_of(row)) for row in packed) == len(docs)
    batch = collate(packed, pad)
    # the first token of a text document is a target unpacked, but not predicted there either
    alone = [collate([d], pad) for d in docs]
    per_doc_packed = per_document_losses(model, batch)
    per_doc_alone = torch.stack([causal_lm_loss(model, b).detach() for b in alone])
    torch.testing.assert_close(per_doc_packed, per_doc_alone, rtol=1e-4, atol=1e-5)
    packed_grads = gradients(model, lambda: causal_lm_loss(model, batch))
    alone_grads = gradients(model, lambda: sum(causal_lm_loss(model, b) for b in alone))
    for a, b in zip(packed_grads, alone_grads):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4 * float(b.abs().max()))


def per_document_losses(model, batch) -> torch.Tensor:
    """The batch's summed loss with the targets of one document at a time (documents start at position 0)."""
    starts = (batch["position_ids"] == 0) & (batch["attention_mask"] == 1)
    document = starts.cumsum(1)
    losses = []
    with torch.no_grad():
        for row in range(batch["input_ids"].shape[0]):
            for d in range(1, int(document[row].max()) + 1):
                keep = torch.zeros_like(starts)
                keep[row] = (document[row] == d) & (batch["attention_mask"][row] == 1)
                losses.append(causal_lm_loss(model, {**batch, "labels": batch["labels"].masked_fill(~keep, -100)}))
    return torch.stack(losses)


def gradients(model, loss) -> list[torch.Tensor]:
    params = lora_parameters(model)
    model.zero_grad(set_to_none=True)
    loss().backward()
    grads = [p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_attention_never_crosses_a_document(loaded, implementation):
    """Changing the first document changes nothing the second one computes; read through the 2D mask (no
    boundaries), the same row would."""
    model, config = loaded.model, loaded.model.get_base_model().config
    first, second = [5 + i for i in range(9)], [300 + 7 * i for i in range(6)]
    row = {"input_ids": first + second, "labels": first + second, "position_ids": [*range(9), *range(6)]}
    other = {**row, "input_ids": [700 + i for i in range(9)] + second}
    batches = [collate([r, rows_of([(1, 3)])[0] | {"position_ids": [0, 1, 2]}], 0) for r in (row, other)]
    saved = config._attn_implementation
    config._attn_implementation = implementation
    try:
        with torch.no_grad():
            packed = [model(**model_inputs(b)).logits[0, 9:] for b in batches]
            plain = [model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[0, 9:] for b in batches]
            alone = model(input_ids=torch.tensor([second])).logits[0]
    finally:
        config._attn_implementation = saved
    torch.testing.assert_close(packed[0], packed[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(packed[0], alone, rtol=1e-4, atol=1e-5)
    assert (plain[0] - plain[1]).abs().max() > 1e-2


def test_packing_refuses_an_attention_that_gets_no_block_mask(loaded):
    config = loaded.model.get_base_model().config
    batch = collate(pack_rows(rows_of([(1, 3), (2, 3)]), 8), 0)
    saved = config._attn_implementation
    config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(BadInput, match="data.packing"):
            causal_lm_loss(loaded.model, batch)
    finally:
        config._attn_implementation = saved


@pytest.fixture(scope="module")
def first_batch() -> tuple[float, int]:
    """The untrained model's mean loss over the first packed batch, computed document by document unpacked, and the
    batch's real tokens."""
    recipe = load_recipe(LAMP2, QA)
    base = load_model(recipe, torch.device("cpu"))
    batch = build_train_batches(recipe, base.tokenizer).batch(0)
    total = targets = 0
    with torch.no_grad():
        for row in range(batch["input_ids"].shape[0]):
            real = {k: batch[k][row][batch["attention_mask"][row] == 1].tolist() for k in ("input_ids", "labels")}
            for doc in _documents_of({**real, "position_ids": batch["position_ids"][row][: len(real["labels"])]}):
                doc["labels"] = [-100, *doc["labels"][1:]]
                one = collate([doc], base.tokenizer.pad_token_id)
                total += float(causal_lm_loss(base.model, one))
                targets += int((one["labels"][:, 1:] != -100).sum())
    return total / targets, int(batch["attention_mask"].sum())


VARIANTS = [
    (("method=lcsb", "lcsb.blocks=2"), 1e-4),
    (("method=lcsb", "lcsb.upper_path=exact", "activation_checkpointing=true"), 1e-4),
    (("method=full-backprop",), 1e-4),
    (("method=freeze", "freeze.layers=1"), 1e-4),
    (("method=lisa", "lisa.layers=1"), 1e-4),
    # the mean of the loss at +eps and -eps
    (("method=mezo", "mezo.lr=1e-3"), 1e-3),
    # int8 weights on the simulated NPU
    (("backend=npu-sim",), 3e-2),
]


@pytest.mark.parametrize("variant, rtol", VARIANTS, ids=[" ".join(v) for v, _ in VARIANTS])
def test_every_method_and_npu_sim_train_on_packed_batches(tmp_path, first_batch, variant, rtol):
    """The first step's loss is the untrained model's on the first packed batch, as its documents give it unpacked."""
    overrides = [*QA, *variant, "train.max_steps=2", "train.warmup_steps=0"]
    expected, tokens = first_batch
    run_train(tmp_path / "run", *overrides)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert rows[0]["tokens"] == tokens
    assert rows[0]["loss"] == pytest.approx(expected, rel=rtol)
    assert math.isfinite(rows[1]["loss"])


def test_packed_batches_are_a_function_of_the_step_and_resume_exactly(tmp_path, loaded):
    recipe = load_recipe(LAMP2, QA)
    late, fresh = build_train_batches(recipe, loaded.tokenizer), build_train_batches(recipe, loaded.tokenizer)
    assert "position_ids" in late.batch(0)
    for i in (40, 3, 41):
        assert_same_tensors(late.batch(i), fresh.batch(i))
    common = (*QA, "train.max_steps=7", "train.save_every=3", "lora.dropout=0.1")
    run_train(tmp_path / "whole", *common)
    cut = tmp_path / "cut"
    run_train(cut, *common)
    shutil.rmtree(cut / "checkpoints" / "step-7")
    shutil.rmtree(cut / "adapter")
    (cut / "summary.json").unlink()
    run_train(cut, *common, resume=True)
    assert_same_tensors(adapter_tensors(cut), adapter_tensors(tmp_path / "whole"))
