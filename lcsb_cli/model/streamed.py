"""The streamed 4-bit build: the model exists on the meta device and is materialised, cast and quantized one module
at a time, so no full-precision copy of it ever exists; its embedding / LM head may be 4-bit rows (rows.py)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call

from ..errors import BadInput
from .memory import seeded
from .rows import QuantizedEmbedding, QuantizedHead, QuantizedRows

# a random-init embedding is drawn (and quantized) this many rows at a time
DRAW_ROWS = 4096


def _tensor_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**62


class FloatSource:
    """Full-precision tensors, one module at a time: a subclass's `fill(model, name, module)` materialises the
    module's own parameters and persistent buffers that are not loaded yet (float32, CPU) and `row_chunks(name,
    module)` yields an embedding or LM head weight in consecutive row chunks; `linear` and `rows` cast them to the
    model dtype and quantize."""

    def linear(self, model, name: str, module: nn.Linear, kind: str, dtype) -> nn.Module:
        self.fill(model, name, module)
        return _linear4bit(module, kind, dtype)

    def rows(self, name: str, module: nn.Module, embedding: str, dtype) -> torch.Tensor | QuantizedRows:
        """The module's weight: whole in `dtype` (memory.embedding keep) or 4-bit rows."""
        rows, cols = module.weight.shape
        chunks = (chunk.to(dtype) for chunk in self.row_chunks(name, module))
        if embedding != "keep":
            return QuantizedRows.quantize(chunks, rows, cols, embedding)
        weight, start = torch.empty(rows, cols, dtype=dtype), 0
        for chunk in chunks:
            weight[start : start + len(chunk)], start = chunk, start + len(chunk)
        return weight


class RandomInit(FloatSource):
    """A preset's seeded random init, drawn per module (and per DRAW_ROWS rows of an embedding) from generators
    seeded by the tensor's name, so the same weights come out whether built whole or one module at a time.
    Each module gets transformers' own `_init_weights` (normal(0, initializer_range), zero biases, unit norms),
    drawn in float32 whatever the model dtype."""

    def __init__(self, seed: int, std: float):
        self.seed, self.std = seed, std

    def fill(self, model, name, module):
        for key, tensor in _unloaded(module):
            _set(
                module,
                key,
                torch.empty(tensor.shape, dtype=torch.float32 if tensor.is_floating_point() else tensor.dtype),
            )
        with seeded(_tensor_seed(self.seed, name)):
            _initializer(model, name)(module)

    def row_chunks(self, name, module):
        rows, cols = module.weight.shape
        padding = getattr(module, "padding_idx", None)
        for start in range(0, rows, DRAW_ROWS):
            chunk = torch.empty(min(DRAW_ROWS, rows - start), cols)
            with seeded(_tensor_seed(self.seed, f"{name}:{start}")):
                torch.nn.init.normal_(chunk, mean=0.0, std=self.std)
            if padding is not None and start <= padding < start + len(chunk):
                chunk[padding - start] = 0
            yield chunk


class SafetensorsCheckpoint(FloatSource):
    """Tensors of a safetensors checkpoint (one file or an index of shards), each file opened per read so the
    pages of its memory map leave the resident set as soon as the tensor is copied out."""

    def __init__(self, path: Path):
        index = path / "model.safetensors.index.json"
        if index.is_file():
            self.files = {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        elif (path / "model.safetensors").is_file():
            from safetensors import safe_open

            with safe_open(path / "model.safetensors", "pt") as f:
                # safe_open has keys() but is not iterable
                self.files = {k: path / "model.safetensors" for k in f.keys()}  # noqa: SIM118
        else:
            raise BadInput(
                f"model.name: {path} has no model.safetensors; memory.streamed_load reads safetensors "
                "checkpoints (save with save_pretrained(safe_serialization=True))"
            )

    def _read(self, key: str, rows: slice | None = None) -> torch.Tensor:
        from safetensors import safe_open

        if key not in self.files:
            raise BadInput(f"model.name: the checkpoint has no tensor {key!r}")
        with safe_open(self.files[key], "pt") as f:
            tensor = f.get_tensor(key) if rows is None else f.get_slice(key)[rows]
            return tensor.to(torch.float32, copy=True) if tensor.is_floating_point() else tensor.clone()

    def _check_shape(self, key: str, shape: torch.Size) -> None:
        from safetensors import safe_open

        with safe_open(self.files[key], "pt") as f:
            found = tuple(f.get_slice(key).get_shape())
        if found != tuple(shape):
            raise BadInput(f"model.name: tensor {key!r} has shape {list(found)}, its config.json says {list(shape)}")

    def fill(self, model, name, module):
        _fill_from(name, module, self._read)

    def row_chunks(self, name, module):
        rows = module.weight.shape[0]
        if f"{name}.weight" in self.files:
            self._check_shape(f"{name}.weight", module.weight.shape)
        for start in range(0, rows, DRAW_ROWS):
            yield self._read(f"{name}.weight", slice(start, min(start + DRAW_ROWS, rows)))


class QuantizedFile(FloatSource):
    """A model `save_quantized` wrote: its tensors are memory-mapped and used in place, nothing is re-quantized."""

    def __init__(self, path: Path):
        from safetensors.torch import load_file

        self.tensors = load_file(path)

    def _get(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def fill(self, model, name, module):
        _fill_from(name, module, self._get)

    def linear(self, model, name, module, kind, dtype):
        import bitsandbytes as bnb

        out = _meta_linear4bit(module, kind, dtype)
        stats = {k: v for k, v in self.tensors.items() if k.startswith(f"{name}.weight.")}
        out.weight = bnb.nn.Params4bit.from_prequantized(self._get(f"{name}.weight"), stats, device="cpu", module=out)
        if module.bias is not None:
            out.bias = nn.Parameter(self._get(f"{name}.bias"), requires_grad=False)
        return out

    def rows(self, name, module, embedding, dtype):
        if embedding == "keep":
            return self._get(f"{name}.weight")
        quantized = QuantizedRows(*module.weight.shape, embedding, device="meta")
        quantized.packed, quantized.absmax = self._get(f"{name}.rows.packed"), self._get(f"{name}.rows.absmax")
        return quantized


def save_quantized(model: nn.Module, path: Path) -> None:
    """The streamed model's tensors (bitsandbytes' own serialization of its 4-bit layers), each storage once."""
    from safetensors.torch import save_file

    tensors, seen = {}, set()
    for key, tensor in model.state_dict().items():
        # the tied LM head shares the embedding's rows
        if tensor.untyped_storage().data_ptr() not in seen:
            seen.add(tensor.untyped_storage().data_ptr())
            tensors[key] = tensor.contiguous()
    save_file(tensors, path)


def streamed_model(config, dtype: torch.dtype, kind: str | None, embedding: str, source: FloatSource) -> nn.Module:
    """The causal LM of `config`, built on the meta device in `dtype` (so every tensor has the dtype transformers gives
    it) and materialised, cast and quantized one module at a time. `kind` (nf4 | fp4; gguf: `source` builds them; None
    keeps them in `dtype`): the Linears transformers' bitsandbytes quantizer converts, in 4-bit with double quant in
    blocks of 64, as `models.quantization_config` asks it. `embedding`: keep (embedding and LM head in `dtype`) | nf4 |
    fp4 (QuantizedRows, shared when tied). What the build cannot reproduce is BadInput, never a different model."""
    from transformers import AutoModelForCausalLM
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    kept = [*get_keys_to_not_convert(model), *(model._keep_in_fp32_modules or [])]
    _build_ends(model, source, embedding, dtype)
    # names only: a replaced module must be freed
    for name in [name for name, _ in model.named_modules()]:
        module = model.get_submodule(name)
        if not _has_meta_tensors(module):
            continue
        if type(module) is nn.Linear and kind is not None and should_convert_module(name, kept):
            _replace(model, name, source.linear(model, name, module, kind, dtype))
        else:
            _materialise(model, name, module, source)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_meta:
            raise BadInput(
                f"model.name: memory.streamed_load cannot build {name} of this {config.model_type} model; "
                "set memory.streamed_load=false"
            )
    # peft gives bitsandbytes layers its 4-bit LoRA class on this flag
    model.is_loaded_in_4bit = kind in ("nf4", "fp4")
    # eval mode, as from_pretrained leaves it: where the CPU has avx512_bf16, bitsandbytes' eval forward takes
    # another kernel, so a model left in train mode scores differently from the normal build on such hosts
    return model.eval()


def _build_ends(model, source: FloatSource, embedding: str, dtype: torch.dtype) -> None:
    """The embedding and LM head, their weights read a row chunk at a time: dense, in the model's own modules
    (embedding keep), or 4-bit rows behind QuantizedEmbedding / QuantizedHead; a tied head shares the embedding's."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is emb.weight
    names = {id(m): n for n, m in model.named_modules()}
    weight = _build_end(model, names[id(emb)], source.rows(names[id(emb)], emb, embedding, dtype), source, dtype)
    if head is not None:
        name = names[id(head)]
        _build_end(model, name, weight if tied else source.rows(name, head, embedding, dtype), source, dtype, head=True)


def _build_end(model, name: str, weight, source: FloatSource, dtype: torch.dtype, head: bool = False):
    """One end (embedding or head) around its weight; returns the weight a tied head shares."""
    module = model.get_submodule(name)
    if isinstance(weight, QuantizedRows):
        # the rows stand in for it: nothing reads or draws it
        module.weight._is_hf_initialized = True
        _materialise(model, name, module, source)
        _replace(
            model,
            name,
            _quantized_head(name, module, weight) if head else _quantized_embedding(name, module, weight, dtype),
        )
        return weight
    module.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
    module.weight._is_hf_initialized = True
    _materialise(model, name, module, source)
    return module.weight


def _quantized_embedding(name: str, module: nn.Module, rows: QuantizedRows, dtype: torch.dtype) -> nn.Module:
    """The 4-bit embedding around the model's own module, which must give a row the same output whatever the rest
    of its weight holds (QuantizedEmbedding hands it only the batch's rows)."""
    embedding = QuantizedEmbedding(rows, dtype, module)
    probe = torch.randn(4, rows.shape[1], generator=torch.Generator().manual_seed(0)).to(dtype)
    ids = torch.tensor([[0, 1]])
    whole = functional_call(embedding.lookup, {"weight": probe}, (ids,))
    if not torch.equal(functional_call(embedding.lookup, {"weight": probe[:2]}, (ids,)), whole):
        raise BadInput(
            f"memory.embedding: the embedding {name} ({type(module).__name__}) reads more of its weight "
            "than the batch's rows, which a 4-bit embedding cannot keep; set memory.embedding=keep"
        )
    return embedding


def _quantized_head(name: str, module: nn.Module, rows: QuantizedRows) -> nn.Module:
    if type(module) is not nn.Linear or module.bias is not None:
        raise BadInput(
            f"memory.embedding: the LM head {name} is a {type(module).__name__}"
            f"{' with a bias' if getattr(module, 'bias', None) is not None else ''}; a 4-bit head is "
            "a bias-free nn.Linear: set memory.embedding=keep"
        )
    return QuantizedHead(rows)


def _materialise(model, name: str, module: nn.Module, source: FloatSource) -> None:
    """A module's own tensors: loaded (or drawn) by `source`, cast to the dtype the meta model gave them, then its
    non-persistent buffers computed."""
    dtypes = {key: tensor.dtype for key, tensor in _persistent(module)}
    source.fill(model, name, module)
    for key, tensor in _persistent(module):
        if tensor.is_floating_point() and tensor.dtype != dtypes[key]:
            _set(module, key, tensor.to(dtypes[key]))
    _rebuild_buffers(model, name, module)


def _rebuild_buffers(model, name: str, module: nn.Module) -> None:
    """Non-persistent buffers (rotary tables, Gemma 3's embedding scale) are in no checkpoint. As transformers'
    meta-device loading does, they start empty and the model's `_init_weights` computes them, every other tensor
    flagged `_is_hf_initialized` so its guarded init functions pass it by. One it leaves unwritten, or a loaded
    tensor it writes, means this module cannot be rebuilt: BadInput."""
    from transformers import initialization

    computed = [key for key in module._non_persistent_buffers_set if module._buffers.get(key) is not None]
    if not computed:
        return
    for key in computed:
        module._buffers[key] = torch.empty_like(module._buffers[key], device="cpu")
    for _, tensor in _persistent(module):
        tensor._is_hf_initialized = True
    before = {key: (tensor, tensor._version) for key, tensor in _own(module)}
    with torch.no_grad(), initialization.guard_torch_init_functions():
        _initializer(model, name)(module)
    written = {key for key, tensor in _own(module) if tensor is not before[key][0] or tensor._version != before[key][1]}
    wrong = sorted(written.symmetric_difference(computed))
    if wrong:
        what = "does not compute it" if wrong[0] in computed else "overwrites it"
        raise BadInput(
            f"model.name: memory.streamed_load cannot rebuild {name}.{wrong[0]} ({type(module).__name__}): "
            f"transformers' _init_weights {what}; set memory.streamed_load=false"
        )


def _initializer(model, name: str):
    """The `_init_weights` transformers applies to module `name`: that of the innermost PreTrainedModel holding it."""
    from transformers import PreTrainedModel

    owner = module = model
    for part in filter(None, name.split(".")):
        module = getattr(module, part)
        owner = module if isinstance(module, PreTrainedModel) else owner
    return owner._init_weights


def _own(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [
        *((k, t) for k, t in module._parameters.items() if t is not None),
        *((k, t) for k, t in module._buffers.items() if t is not None),
    ]


def _persistent(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A module's own parameters and persistent buffers: what a checkpoint holds."""
    return [(k, t) for k, t in _own(module) if k not in module._non_persistent_buffers_set]


def _unloaded(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(k, t) for k, t in _persistent(module) if not getattr(t, "_is_hf_initialized", False)]


def _set(module: nn.Module, key: str, tensor: torch.Tensor) -> None:
    if key in module._parameters:
        module._parameters[key] = nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[key] = tensor


def _fill_from(name: str, module: nn.Module, read) -> None:
    for local, tensor in _unloaded(module):
        key = f"{name}.{local}" if name else local
        value = read(key)
        if value.shape != tensor.shape:
            raise BadInput(
                f"model.name: tensor {key!r} has shape {list(value.shape)}, its config.json says {list(tensor.shape)}"
            )
        _set(module, local, value)


def _has_meta_tensors(module: nn.Module) -> bool:
    return any(tensor.is_meta for _, tensor in _own(module))


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def _meta_linear4bit(linear: nn.Linear, kind: str, dtype: torch.dtype) -> nn.Module:
    """An empty bitsandbytes Linear4bit of `linear`'s shape (double quant), its weight still to be set."""
    import bitsandbytes as bnb

    return bnb.nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        compute_dtype=dtype,
        compress_statistics=True,
        quant_type=kind,
        device="meta",
    )


def _linear4bit(linear: nn.Linear, kind: str, dtype: torch.dtype) -> nn.Module:
    import bitsandbytes as bnb

    out = _meta_linear4bit(linear, kind, dtype)
    out.weight = bnb.nn.Params4bit(
        linear.weight.data.to(dtype), requires_grad=False, compress_statistics=True, quant_type=kind, module=out
    ).to("cpu")
    if linear.bias is not None:
        out.bias = nn.Parameter(linear.bias.data.to(dtype), requires_grad=False)
    return out
