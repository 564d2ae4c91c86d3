"""The streamed 4-bit build: the model exists on the meta device and is materialised, cast and quantized one module
at a time, so no full-precision copy of it ever exists; and a 4-bit embedding / LM head read a slice at a time."""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from ..errors import BadInput
from .memory import seeded

ROW_BLOCK = 64  # bitsandbytes' 4-bit block size: a row of H values is H / 64 whole blocks


class QuantizedRows(nn.Module):
    """A [rows x cols] weight in bitsandbytes 4-bit (NF4/FP4) blocks of 64 along each row, fp32 absmax per block.

    Every row is whole blocks, so any set of rows dequantizes on its own: the embedding reads the rows of the
    batch's tokens and the LM head one vocabulary slice at a time; the full-precision matrix never exists.
    """

    def __init__(self, rows: int, cols: int, quant_type: str, device=None):
        super().__init__()
        if cols % ROW_BLOCK:
            raise BadInput(f"memory.embedding: 4-bit rows need a hidden size that is a multiple of {ROW_BLOCK}, "
                           f"this model's is {cols}; set memory.embedding=keep")
        self.shape, self.quant_type = (rows, cols), quant_type
        self.register_buffer("packed", torch.empty(rows, cols // 2, dtype=torch.uint8, device=device))
        self.register_buffer("absmax", torch.empty(rows, cols // ROW_BLOCK, dtype=torch.float32, device=device))

    @classmethod
    def quantize(cls, chunks: Iterable[torch.Tensor], rows: int, cols: int, quant_type: str) -> QuantizedRows:
        """Quantize a weight given as consecutive row chunks (each freed before the next is drawn)."""
        from bitsandbytes.functional import quantize_4bit

        out = cls(rows, cols, quant_type, device="cpu")
        start = 0
        for chunk in chunks:
            packed, state = quantize_4bit(chunk.contiguous(), blocksize=ROW_BLOCK, quant_type=quant_type)
            stop = start + chunk.shape[0]
            out.packed[start:stop] = packed.view(-1, cols // 2)
            out.absmax[start:stop] = state.absmax.view(-1, cols // ROW_BLOCK)
            start = stop
        return out

    def _dequantize(self, packed: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        from bitsandbytes.functional import QuantState, dequantize_4bit, get_4bit_type

        shape = (packed.shape[0], self.shape[1])
        state = QuantState(absmax=absmax.reshape(-1), shape=shape, dtype=dtype, blocksize=ROW_BLOCK,
                           code=get_4bit_type(self.quant_type, device=packed.device), quant_type=self.quant_type)
        return dequantize_4bit(packed.reshape(-1, 1), state)

    def slice(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        return self._dequantize(self.packed[start:stop], self.absmax[start:stop], dtype)

    def take(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self._dequantize(self.packed[index], self.absmax[index], dtype)


class QuantizedEmbedding(nn.Module):
    """nn.Embedding over QuantizedRows: looks up and dequantizes only the batch's rows."""

    def __init__(self, rows: QuantizedRows, dtype: torch.dtype):
        super().__init__()
        self.rows, self.dtype = rows, dtype
        self.num_embeddings, self.embedding_dim = rows.shape

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = self.rows.take(input_ids.reshape(-1), self.dtype)
        return flat.view(*input_ids.shape, self.embedding_dim)


class QuantizedHead(nn.Module):
    """The LM head over QuantizedRows (shared with the embedding when they are tied), a vocabulary slice at a time.

    `causal_lm_loss` reads `weight_slice` inside its chunked cross-entropy; `forward` (evaluation, full-logits
    paths) returns ordinary logits built slice by slice.
    """

    def __init__(self, rows: QuantizedRows, slice_rows: int = 8192):
        super().__init__()
        self.rows, self.slice_rows = rows, slice_rows
        self.out_features, self.in_features = rows.shape

    def weight_slice(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        return self.rows.slice(start, stop, dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.nn.functional.linear(hidden, self.weight_slice(v, v + self.slice_rows, hidden.dtype))
                          for v in range(0, self.out_features, self.slice_rows)], dim=-1)


DRAW_ROWS = 4096  # a random-init embedding is drawn (and quantized) this many rows at a time


def _tensor_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**62


class FloatSource:
    """Full-precision tensors, one module at a time: a subclass's `fill(model, name, module)` materialises a
    module's own parameters and buffers (float32, CPU) and `row_chunks(name, module)` yields an embedding or LM
    head weight in consecutive row chunks; `linear` and `rows` cast them to the model dtype and quantize."""

    def linear(self, model, name: str, module: nn.Linear, kind: str, dtype) -> nn.Module:
        self.fill(model, name, module)
        return _linear4bit(module, kind, dtype)

    def rows(self, name: str, module: nn.Module, embedding: str, dtype, head: bool) -> nn.Module:
        rows, cols = module.weight.shape
        chunks = (chunk.to(dtype) for chunk in self.row_chunks(name, module))
        if embedding != "keep":
            quantized = QuantizedRows.quantize(chunks, rows, cols, embedding)
            return QuantizedHead(quantized) if head else QuantizedEmbedding(quantized, dtype)
        weight, start = torch.empty(rows, cols, dtype=dtype), 0
        for chunk in chunks:
            weight[start:start + len(chunk)], start = chunk, start + len(chunk)
        return _dense(weight, head)


class RandomInit(FloatSource):
    """A preset's seeded random init, drawn per module (and per DRAW_ROWS rows of an embedding) from generators
    seeded by the tensor's name, so the same weights come out whether built whole or one module at a time.
    Each module gets transformers' own `_init_weights` (normal(0, initializer_range), zero biases, unit norms)."""

    def __init__(self, seed: int, std: float):
        self.seed, self.std = seed, std

    def fill(self, model, name, module):
        module.to_empty(device="cpu", recurse=False)
        with seeded(_tensor_seed(self.seed, name)):
            model._init_weights(module)

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
                self.files = {k: path / "model.safetensors" for k in f.keys()}
        else:
            raise BadInput(f"model.name: {path} has no model.safetensors; memory.streamed_load reads safetensors "
                           "checkpoints (save with save_pretrained(safe_serialization=True))")

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
        _fill_from(model, name, module, self._read)

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
        _fill_from(model, name, module, self._get)

    def linear(self, model, name, module, kind, dtype):
        import bitsandbytes as bnb

        out = bnb.nn.Linear4bit(module.in_features, module.out_features, bias=module.bias is not None,
                                compute_dtype=dtype, quant_type=kind, device="meta")
        stats = {k: v for k, v in self.tensors.items() if k.startswith(f"{name}.weight.")}
        out.weight = bnb.nn.Params4bit.from_prequantized(self._get(f"{name}.weight"), stats, device="cpu", module=out)
        if module.bias is not None:
            out.bias = nn.Parameter(self._get(f"{name}.bias"), requires_grad=False)
        return out

    def rows(self, name, module, embedding, dtype, head):
        if embedding == "keep":
            return _dense(self._get(f"{name}.weight"), head)
        quantized = QuantizedRows(*module.weight.shape, embedding, device="meta")
        quantized.packed, quantized.absmax = self._get(f"{name}.rows.packed"), self._get(f"{name}.rows.absmax")
        return QuantizedHead(quantized) if head else QuantizedEmbedding(quantized, dtype)


def save_quantized(model: nn.Module, path: Path) -> None:
    """The streamed model's tensors (bitsandbytes' own serialization of its 4-bit layers), each storage once."""
    from safetensors.torch import save_file

    tensors, seen = {}, set()
    for key, tensor in model.state_dict().items():
        if tensor.untyped_storage().data_ptr() not in seen:  # the tied LM head shares the embedding's rows
            seen.add(tensor.untyped_storage().data_ptr())
            tensors[key] = tensor.contiguous()
    save_file(tensors, path)


def streamed_model(config, dtype: torch.dtype, kind: str | None, embedding: str, source: FloatSource) -> nn.Module:
    """The causal LM of `config`, built on the meta device and materialised, cast to `dtype` and quantized one
    module at a time. `kind` (nf4 | fp4; None keeps them in `dtype`): every Linear but the LM head in
    bitsandbytes 4-bit with double quant in blocks of 64, as `models.quantization_config` asks transformers for.
    `embedding`: keep (embedding and LM head in `dtype`) | nf4 | fp4 (QuantizedRows, shared when tied)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is emb.weight
    for name in [name for name, _ in model.named_modules()]:  # names only: a replaced module must be freed
        module = model.get_submodule(name)
        if module is emb or module is head or not _has_meta_tensors(module):
            continue
        if type(module) is nn.Linear and kind is not None:
            _replace(model, name, source.linear(model, name, module, kind, dtype))
            continue
        source.fill(model, name, module)
        for param in module.parameters(recurse=False):
            param.data = param.data.to(dtype)
    names = {id(m): n for n, m in model.named_modules()}
    new_emb = source.rows(names[id(emb)], emb, embedding, dtype, head=False)
    _replace(model, names[id(emb)], new_emb)
    if head is not None:
        new_head = _tied_head(new_emb) if tied else source.rows(names[id(head)], head, embedding, dtype, True)
        _replace(model, names[id(head)], new_head)
    model.is_loaded_in_4bit = kind is not None  # peft gives bitsandbytes layers its 4-bit LoRA class on this flag
    return model


def _fill_from(model: nn.Module, name: str, module: nn.Module, read) -> None:
    own = [n for n, _ in module.named_parameters(recurse=False)]
    own += [n for n, _ in module.named_buffers(recurse=False) if n not in module._non_persistent_buffers_set]
    if not own:  # only computed buffers (rotary frequencies): transformers recomputes them the same way
        module.to_empty(device="cpu", recurse=False)
        model._init_weights(module)
    for local in own:
        key = f"{name}.{local}" if name else local
        tensor = read(key)
        if tensor.shape != getattr(module, local).shape:
            raise BadInput(f"model.name: tensor {key!r} has shape {list(tensor.shape)}, its config.json says "
                           f"{list(getattr(module, local).shape)}")
        setattr(module, local, nn.Parameter(tensor, requires_grad=False) if local in module._parameters else tensor)


def _has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)])


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def _linear4bit(linear: nn.Linear, kind: str, dtype: torch.dtype) -> nn.Module:
    import bitsandbytes as bnb

    out = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                            compute_dtype=dtype, compress_statistics=True, quant_type=kind, device="meta")
    out.weight = bnb.nn.Params4bit(linear.weight.data.to(dtype), requires_grad=False, compress_statistics=True,
                                   quant_type=kind, module=out).to("cpu")
    if linear.bias is not None:
        out.bias = nn.Parameter(linear.bias.data.to(dtype), requires_grad=False)
    return out


def _dense(weight: torch.Tensor, head: bool) -> nn.Module:
    rows, cols = weight.shape
    module = nn.Linear(cols, rows, bias=False, device="meta") if head else nn.Embedding(rows, cols, device="meta")
    module.weight = nn.Parameter(weight, requires_grad=False)
    return module


def _tied_head(embedding: nn.Module) -> nn.Module:
    if isinstance(embedding, QuantizedEmbedding):
        return QuantizedHead(embedding.rows)
    head = nn.Linear(embedding.embedding_dim, embedding.num_embeddings, bias=False, device="meta")
    head.weight = embedding.weight
    return head


