"""A damaged adapter is bad input (issue 56): wherever lcsb reads one (eval, export in every format, generate, chat,
--adapter, a per-user run's adapters), a truncated or empty weights file, a config that is not JSON or lacks `r` or
`target_modules`, a tensor of the wrong shape, a missing tensor or a truncated adapter GGUF gets exit 2 and one line
naming the file, and the run directory stays byte-identical. Adapters written by plain peft, and the adapter GGUF
lcsb exports, still load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import pytest
import torch
from helpers import LAMP2, REPO, assert_one_line_error, assert_same_tensors, cli, run_train, snapshot
from safetensors.torch import load_file, save_file

from lcsb_cli.errors import BadInput
from lcsb_cli.export import export_run
from lcsb_cli.model import adapter as adapters
from lcsb_cli.model.gguf import adapter as gguf_adapter

pytestmark = pytest.mark.xdist_group("damaged-adapter")
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


def _cut(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _edit_config(adapter: Path, key: str, value=None) -> None:
    """The config without `key`, or with `value` for it."""
    config = json.loads((adapter / CONFIG).read_text())
    if value is None:
        del config[key]
    else:
        config[key] = value
    (adapter / CONFIG).write_text(json.dumps(config))


def _edit_tensors(adapter: Path, edit) -> None:
    tensors = load_file(adapter / WEIGHTS)
    key = sorted(tensors)[0]
    edit(tensors, key)
    save_file(tensors, adapter / WEIGHTS, metadata={"format": "pt"})


# name -> (damage done to an adapter dir, the file and the words its error line names)
DAMAGES = {
    "truncated-weights": (lambda a: _cut(a / WEIGHTS, 0.5), WEIGHTS, "do not load"),
    "empty-weights": (lambda a: _cut(a / WEIGHTS, 0), WEIGHTS, "do not load"),
    "config-not-json": (lambda a: _cut(a / CONFIG, 0.3), CONFIG, "JSON"),
    "config-without-r": (lambda a: _edit_config(a, "r"), CONFIG, "lacks 'r'"),
    "config-without-targets": (lambda a: _edit_config(a, "target_modules"), CONFIG, "lacks 'target_modules'"),
    "config-targets-no-layer": (lambda a: _edit_config(a, "target_modules", ["qproj"]), CONFIG, "qproj"),
    "tensor-of-wrong-shape": (
        lambda a: _edit_tensors(a, lambda t, k: t.update({k: t[k][:, :-1].contiguous()})),
        WEIGHTS,
        "has shape",
    ),
    "missing-tensor": (lambda a: _edit_tensors(a, lambda t, k: t.pop(k)), WEIGHTS, "missing"),
}
PROMPT = ["--prompt", "A detective in a rainy city", "--max-new-tokens", "3"]
# where the damaged adapter is read: the run's adapter/ through each verb, --adapter, a per-user run's adapters/ID
READERS = {
    "eval": ("run", ["eval", "{run}"]),
    "export": ("run", ["export", "{run}", "--output", "{new}"]),
    "export-merge": ("run", ["export", "{run}", "--merge", "--output", "{new}"]),
    "export-gguf": ("run", ["export", "{run}", "--format", "gguf", "--output", "{new}.gguf"]),
    "generate": ("run", ["generate", "{run}", *PROMPT]),
    "chat": ("run", ["chat", "{run}"]),
    "eval-adapter-flag": ("run", ["eval", str(LAMP2), "--adapter", "{run}/adapter", "--output", "{new}"]),
    "eval-per-user": ("users", ["eval", "{run}"]),
    "export-user": ("users", ["export", "{run}", "--user", "{user}", "--output", "{new}"]),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """A finished tiny run, its adapter GGUF, and a per-user run of two users."""
    root = tmp_path_factory.mktemp("damaged-adapter")
    run_train(root / "run", "train.max_steps=2", "train.save_every=0")
    dev = json.loads((REPO / "recipes" / "data" / "lamp2" / "dev_questions.json").read_text())
    users = sorted({q["user_id"] for q in dev})[:2]
    (root / "two.json").write_text(json.dumps([q for q in dev if q["user_id"] in users]))
    run_train(
        root / "users",
        "data.user=all",
        f"data.eval={root / 'two.json'}",
        "train.max_steps=1",
        "train.save_every=0",
        "overnight.report=false",
    )
    good_gguf = export_run(root / "run", root / "good.gguf", fmt="gguf")
    return {"root": root, "user": users[-1], "gguf": good_gguf}


def _refused(argv: list[str], run: Path, needles: tuple[str, ...], new: Path) -> None:
    """Exit 2 and one line naming every needle; the run dir byte-identical and no output written."""
    before = snapshot(run)
    proc = cli(*argv)
    assert_one_line_error(proc, *needles)
    assert snapshot(run) == before, "the refused command changed the run directory"
    assert not any(new.parent.glob(f"{new.name}*")), "the refused command wrote an output"


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_adapter_is_refused_in_one_line_and_the_run_is_untouched(world, tmp_path, damage, reader):
    kind, args = READERS[reader]
    run = shutil.copytree(world["root"] / kind, tmp_path / kind)
    adapter = run / ("adapter" if kind == "run" else f"adapters/{world['user']}")
    spoil, file, words = DAMAGES[damage]
    spoil(adapter)
    new = tmp_path / "out" / "new"
    new.parent.mkdir()
    argv = [a.format(run=run, new=new, user=world["user"]) for a in args]
    _refused(argv, run, (str(adapter / file), words), new)


def _gguf_copy(source: Path, target: Path, drop: str | None = None, kind: str = "adapter") -> Path:
    """`source`'s fields and tensors written again, without the tensor `drop` and with general.type `kind`."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, str(reader.fields["general.architecture"].contents()))
    writer.add_type(kind)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(reader.fields[gguf.Keys.Adapter.LORA_ALPHA].contents()))
    for tensor in reader.tensors:
        if tensor.name != drop:
            writer.add_tensor(tensor.name, tensor.data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def _truncated_copy(source: Path, target: Path) -> None:
    shutil.copy(source, target)
    _cut(target, 0.6)


GGUF_DAMAGES = {
    "truncated": (_truncated_copy, "truncated or damaged"),
    "missing-tensor": (lambda good, bad: _gguf_copy(good, bad, drop="blk.1.attn_v.weight.lora_b"), "missing"),
    "not-an-adapter": (lambda good, bad: _gguf_copy(good, bad, kind="model"), "general.type=model"),
}


@pytest.mark.parametrize("verb", [["eval"], ["generate", *PROMPT], ["chat"]])
@pytest.mark.parametrize("damage", GGUF_DAMAGES)
def test_a_damaged_adapter_gguf_is_refused_in_one_line(world, tmp_path, damage, verb):
    run = shutil.copytree(world["root"] / "run", tmp_path / "run")
    spoil, words = GGUF_DAMAGES[damage]
    bad = tmp_path / "bad.gguf"
    spoil(world["gguf"], bad)
    _refused([verb[0], str(run), "--adapter", str(bad), *verb[1:]], run, (str(bad), words), tmp_path / "out")


def test_the_exported_adapter_gguf_reads_back_as_the_run_adapter(world):
    """lcsb's own adapter GGUF (F32) is the run's adapter, tensor for tensor, and decodes alike."""
    from lcsb_cli.model.load import load_model
    from lcsb_cli.recipe import load_recipe

    run = world["root"] / "run"
    loaded = load_model(load_recipe(run / "config.yaml"), torch.device("cpu"))
    read = adapters.read(world["gguf"], loaded.model.get_base_model())
    assert_same_tensors(read.tensors, load_file(run / "adapter" / WEIGHTS))
    assert (read.config.r, read.config.lora_alpha) == (16, 32.0)
    assert cli("generate", str(run), "--adapter", str(world["gguf"]), *PROMPT).stdout == (
        cli("generate", str(run), *PROMPT).stdout
    )


def test_a_llama_adapter_gguf_gets_its_q_k_rows_back_in_hf_order(tmp_path):
    """llama's adapter GGUF interleaves q/k output rows (rotary halves); reading it undoes that exactly."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"]))
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            parameter.data.normal_()
    tensors = get_peft_model_state_dict(model)
    written = adapters.Adapter(tmp_path, tmp_path, model.active_peft_config, tensors)
    base = gguf_adapter.Base("llama", 2, 4, 2, None)
    gguf_adapter.write_adapter(written, base, tmp_path / "llama.gguf", "f32", "llama")
    read = adapters.read(tmp_path / "llama.gguf", model.get_base_model())
    assert_same_tensors(read.tensors, tensors)


@pytest.mark.parametrize("safetensors", [True, False], ids=["safetensors", "bin"])
def test_an_adapter_written_by_plain_peft_loads(world, tmp_path, safetensors):
    """peft's own save_pretrained (other targets and rank than the recipe's, safetensors or a .bin pickle): lcsb
    loads exactly its tensors and decodes with them."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from lcsb_cli.model.load import load_model, resolve_base_dir
    from lcsb_cli.recipe import load_recipe

    base = AutoModelForCausalLM.from_pretrained(resolve_base_dir("tiny-qwen2"))
    plain = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, parameter in plain.named_parameters():
        if "lora_B" in name:
            parameter.data.normal_(generator=torch.Generator().manual_seed(len(name)))
    plain.save_pretrained(tmp_path / "plain", safe_serialization=safetensors)
    loaded = load_model(load_recipe(LAMP2), torch.device("cpu"), tmp_path / "plain")
    assert_same_tensors(
        get_peft_model_state_dict(loaded.model, save_embedding_layers=False), get_peft_model_state_dict(plain)
    )
    proc = cli("generate", str(LAMP2), "--adapter", str(tmp_path / "plain"), *PROMPT)
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr


def test_a_tensor_set_that_does_not_fit_the_model_is_refused_naming_its_source(world):
    """The check the best adapter and a resumed checkpoint go through (adapter.apply)."""
    from lcsb_cli.model.load import load_model
    from lcsb_cli.recipe import load_recipe

    run = world["root"] / "run"
    loaded = load_model(load_recipe(run / "config.yaml"), torch.device("cpu"), run / "adapter")
    tensors = load_file(run / "adapter" / WEIGHTS)
    key = sorted(tensors)[0]
    with pytest.raises(BadInput, match=r"the best adapter \(step 4\): 1 of the \d+ tensors .* missing"):
        adapters.apply(loaded.model, {k: v for k, v in tensors.items() if k != key}, "the best adapter (step 4)")
    with pytest.raises(BadInput, match="has shape"):
        adapters.apply(loaded.model, {**tensors, key: tensors[key][:1]}, "checkpoint")
    with pytest.raises(BadInput, match="has no place"):
        adapters.apply(loaded.model, {**tensors, "base_model.model.extra.lora_A.weight": tensors[key]}, "checkpoint")
