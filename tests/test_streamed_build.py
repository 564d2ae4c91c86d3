"""The streamed 4-bit build (model/streamed.py) builds the model transformers' own bitsandbytes load builds, on every
architecture family lcsb accepts, from the same checkpoint: with the embedding kept, the same modules, buffers and
logits; with a 4-bit embedding and head, the normal build over the same 4-bit rows. What it cannot reproduce it
refuses, naming the module."""

import shutil

import pytest
import torch
import torch.nn.functional as F
from helpers import LAMP2, cli
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from lcsb_cli.errors import BadInput
from lcsb_cli.model import load as models
from lcsb_cli.model import streamed

# the memory recipes' model.dtype
DTYPE = torch.bfloat16
SMALL = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "initializer_range": 0.2,
    # a confident model: a lost scale or rotary table moves its loss far more than 1 %
}
# sliding windows shorter than the batch's rows, so the sliding masks cut
WINDOW = 8
ARCHITECTURES = {
    # an LM head of its own
    "llama": {"tie_word_embeddings": False},
    "qwen2": {"tie_word_embeddings": True},
    "mistral": {"sliding_window": WINDOW, "tie_word_embeddings": True},
    # embedding scaled by sqrt(hidden) (a non-persistent buffer), local and global layers, each
    "gemma3_text": {
        # type with its own rotary table (the global one linearly scaled), a tied head
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        },
    },
    "phi3": {"pad_token_id": 0, "tie_word_embeddings": False},
}
BATCH = torch.randint(0, 512, (2, 3 * WINDOW), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", params=[*ARCHITECTURES, "lamp-tiny"])
def checkpoint(request, tmp_path_factory):
    """A small random-init checkpoint of the architecture (the shipped lamp-tiny preset: its own)."""
    if request.param == "lamp-tiny":
        return models.materialize_preset("lamp-tiny")
    path = tmp_path_factory.mktemp(request.param)
    config = AutoConfig.for_model(request.param, **SMALL, **ARCHITECTURES[request.param])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def normal_build(path):
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=DTYPE, quantization_config=models.quantization_config("nf4", DTYPE), device_map={"": "cpu"}
    )


def streamed_build(path, embedding: str):
    return streamed.streamed_model(
        AutoConfig.from_pretrained(path), DTYPE, "nf4", embedding, streamed.SafetensorsCheckpoint(path)
    )


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=BATCH).logits.float()


def loss(model) -> float:
    return float(F.cross_entropy(logits(model)[:, :-1].flatten(0, 1), BATCH[:, 1:].flatten()))


def test_kept_embedding_builds_the_same_modules_buffers_and_logits(checkpoint):
    normal, built = normal_build(checkpoint), streamed_build(checkpoint, "keep")
    assert {n: type(m) for n, m in built.named_modules()} == {n: type(m) for n, m in normal.named_modules()}
    assert built.training == normal.training
    buffers = dict(built.named_buffers())
    assert buffers.keys() == dict(normal.named_buffers()).keys()
    for name, buffer in normal.named_buffers():
        assert buffers[name].dtype == buffer.dtype and torch.equal(buffers[name], buffer), name
    assert (built.get_output_embeddings().weight is built.get_input_embeddings().weight) == (
        normal.get_output_embeddings().weight is normal.get_input_embeddings().weight
    )
    torch.testing.assert_close(logits(built), logits(normal), rtol=0, atol=1e-5)


def with_4bit_rows(model):
    """The model with its embedding and LM head weights replaced by their NF4 round trip, as the build packs them."""
    for weight in {
        id(w): w for w in (model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    }.values():
        rows = streamed.QuantizedRows.quantize([weight.data], *weight.shape, "nf4")
        weight.data = rows.slice(0, weight.shape[0], DTYPE)
    return model


def test_4bit_embedding_and_head_are_the_normal_build_over_the_same_4bit_rows(checkpoint):
    """The 4-bit embedding itself costs a few % of loss on a confident model (the real Gemma 3 270M: 2.67 -> 2.78),
    so the reference is the normal build over the same NF4 rows: the loss within 0.1 %, the logits close."""
    normal, built = with_4bit_rows(normal_build(checkpoint)), streamed_build(checkpoint, "nf4")
    assert isinstance(built.get_input_embeddings(), streamed.QuantizedEmbedding)
    assert abs(loss(built) - loss(normal)) <= 0.001 * loss(normal)
    torch.testing.assert_close(logits(built), logits(normal), rtol=0, atol=1e-5)


class ShiftedEmbedding(nn.Embedding):
    """Adds its weight's mean row to every row: an output that depends on rows the batch does not hold."""

    def forward(self, input_ids):
        return super().forward(input_ids) + self.weight.mean(0)


class OddBufferConfig(LlamaConfig):
    model_type = "lcsb-odd-buffer"


class OddBufferForCausalLM(LlamaForCausalLM):
    """Llama whose final norm holds a non-persistent buffer transformers' `_init_weights` does not compute."""

    config_class = OddBufferConfig

    def __init__(self, config):
        super().__init__(config)
        self.model.norm.register_buffer("table", torch.arange(4.0), persistent=False)


class OddEmbeddingConfig(LlamaConfig):
    model_type = "lcsb-odd-embedding"


class OddEmbeddingForCausalLM(LlamaForCausalLM):
    config_class = OddEmbeddingConfig

    def __init__(self, config):
        super().__init__(config)
        self.model.embed_tokens = ShiftedEmbedding(config.vocab_size, config.hidden_size)


def odd_config(config_class, model_class):
    AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)
    return config_class(**{**SMALL, "initializer_range": 0.02, "tie_word_embeddings": False})


def test_a_buffer_that_cannot_be_rebuilt_is_refused_by_name():
    config = odd_config(OddBufferConfig, OddBufferForCausalLM)
    with pytest.raises(BadInput, match=r"cannot rebuild model\.norm\.table \(LlamaRMSNorm\)"):
        streamed.streamed_model(config, DTYPE, "nf4", "keep", streamed.RandomInit(0, 0.02))


def test_an_embedding_class_a_4bit_embedding_cannot_keep_is_refused_and_kept_whole_it_builds():
    config = odd_config(OddEmbeddingConfig, OddEmbeddingForCausalLM)
    with pytest.raises(BadInput, match=r"embedding model\.embed_tokens \(ShiftedEmbedding\) reads more of its"):
        streamed.streamed_model(config, DTYPE, "nf4", "nf4", streamed.RandomInit(0, 0.02))
    model = streamed.streamed_model(config, DTYPE, "nf4", "keep", streamed.RandomInit(0, 0.02))
    assert type(model.get_input_embeddings()) is ShiftedEmbedding and torch.isfinite(logits(model)).all()


def test_a_head_a_4bit_head_cannot_keep_is_one_line_of_bad_input_through_the_cli(tmp_path):
    # its LM head has a bias
    config = AutoConfig.for_model("phi", **{**SMALL, "initializer_range": 0.02})
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "phi")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(models.TOKENIZER_DIR / "lcsb-bpe" / name, tmp_path / "phi" / name)
    result = cli(
        "train",
        str(LAMP2),
        f"model.name={tmp_path / 'phi'}",
        "quantization=nf4",
        "memory.streamed_load=true",
        "memory.embedding=nf4",
        "--output",
        str(tmp_path / "run"),
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        (
            "error: memory.embedding: the LM head lm_head is a Linear with a bias; a 4-bit head is a bias-free "
            "nn.Linear: set memory.embedding=keep"
        )
    ]
