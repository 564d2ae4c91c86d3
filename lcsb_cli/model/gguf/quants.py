"""GGUF block formats dequantized with torch tensor ops, bit for bit as the gguf package's numpy reference.

Each dequantizer mirrors `gguf.quants.<TYPE>.dequantize_blocks`: the same f16-to-f32 scale conversions, the same
integer values and the same float32 products and sums in the same order (`d * q + m`, `(d * sc) * q - dmin * m`),
so the result equals `gguf.quants.dequantize` exactly. The integer work (nibbles, high bits, offsets) stays in uint8
/ int8; each block format pays one conversion to float32 and one or two in-place float passes.
"""

from __future__ import annotations

import gguf
import torch

from ...errors import BadInput

T = gguf.GGMLQuantizationType
# Q4_K / Q5_K: the 12 bytes packing the 8 sub-blocks' 6-bit scales and mins, after the two f16s d and dmin
K_SCALES = slice(4, 16)
# row b: bits 0..7 of byte b, each moved to bit 4; Q5_0 / Q5_1 expand their 4 qh bytes with one gather of these rows,
# several times faster than 8 shift passes over so narrow a slice
HIGH_BITS = ((torch.arange(256, dtype=torch.uint8).unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1) << 4
# IQ4_NL / IQ4_XS: the 16 non-linear levels a 4-bit index stands for (gguf's `IQ4_NL.kvalues`)
IQ4_LEVELS = torch.tensor(gguf.quants.IQ4_NL.kvalues, dtype=torch.float32)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The f16 at byte `start` of each block, as a float32 column [blocks, 1]."""
    return blocks[:, start : start + 2].view(torch.float16).float()


def _nibbles(blocks: torch.Tensor, start: int, stop: int, group: int) -> torch.Tensor:
    """Bytes start:stop in groups of `group` bytes, each group's low nibbles then its high nibbles:
    uint8 [blocks, 2 * groups, group]."""
    low = (blocks & 0x0F)[:, start:stop].unflatten(1, (-1, group))
    high = (blocks >> 4)[:, start:stop].unflatten(1, (-1, group))
    return torch.stack((low, high), dim=2).flatten(1, 2)


def _bit_planes(qh: torch.Tensor, bits: int, shift: int) -> torch.Tensor:
    """The `bits`-wide fields of each byte of qh [..., n], lowest first, moved up by `shift`: [..., 8 // bits, n]."""
    # bit ops on a narrow strided slice of the blocks run several times slower than on a compact copy
    qh = qh.contiguous()
    mask = (1 << bits) - 1
    return torch.stack([((qh >> i) & mask) << shift for i in range(0, 8, bits)], dim=-2)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks, 2, 18, 16).flatten(1).view(torch.int8) - 8
    return q.float().mul_(_f16(blocks, 0))


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks, 4, 20, 16).flatten(1)
    return q.float().mul_(_f16(blocks, 0)).add_(_f16(blocks, 2))


def _five_bits(blocks: torch.Tensor, qh_at: int) -> torch.Tensor:
    """Q5_0 / Q5_1: 32 low nibbles | bit i of the little-endian 32-bit qh at `qh_at`, as bit 4: uint8 [blocks, 32]."""
    qh = blocks[:, qh_at : qh_at + 4].flatten().int()
    high = HIGH_BITS.to(blocks.device).index_select(0, qh).view(-1, 32)
    return _nibbles(blocks, qh_at + 4, qh_at + 20, 16).flatten(1) | high


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _five_bits(blocks, 2).view(torch.int8) - 16
    return q.float().mul_(_f16(blocks, 0))


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    return _five_bits(blocks, 4).float().mul_(_f16(blocks, 0)).add_(_f16(blocks, 2))


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].view(torch.int8).float().mul_(_f16(blocks, 0))


def _k_scale_min(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 8 six-bit sub-block scales and mins (gguf's `Q4_K.get_scale_min`): uint8 [blocks, 8] each."""
    d, m, m_d = blocks[:, K_SCALES].unflatten(1, (3, 4)).unbind(1)
    sc = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mins = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc, mins


def _k_affine(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(d * sc) * q - dmin * m over the 8 sub-blocks of 32 values of q [blocks, 8, 32]."""
    sc, mins = _k_scale_min(blocks)
    scale = (_f16(blocks, 0) * sc.float()).unsqueeze(-1)
    offset = (_f16(blocks, 2) * mins.float()).unsqueeze(-1)
    return q.float().mul_(scale).sub_(offset).flatten(1)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    return _k_affine(blocks, _nibbles(blocks, 16, 144, 32))


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    return _k_affine(blocks, _nibbles(blocks, 48, 176, 32) | _bit_planes(blocks[:, 16:48], 1, 4))


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    low = _nibbles(blocks, 0, 128, 64).flatten(1)
    high = _bit_planes(blocks[:, 128:192].unflatten(1, (2, 32)), 2, 4).flatten(1)
    q = (low | high).view(torch.int8) - 32
    scale = (_f16(blocks, 208) * blocks[:, 192:208].view(torch.int8).float()).unsqueeze(-1)
    return q.float().unflatten(1, (16, 16)).mul_(scale).flatten(1)


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    """16 sub-blocks of 16 two-bit values: (d * scale) * q - dmin * min, each 4-bit scale and min in one byte."""
    scales = blocks[:, :16]
    q = _bit_planes(blocks[:, 16:80].unflatten(1, (2, 32)), 2, 0).flatten(1).unflatten(1, (16, 16))
    scale = (_f16(blocks, 80) * (scales & 0x0F).float()).unsqueeze(-1)
    offset = (_f16(blocks, 82) * (scales >> 4).float()).unsqueeze(-1)
    return q.float().mul_(scale).sub_(offset).flatten(1)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    """16 sub-blocks of 16 values: two low bits, minus 4 where the high-bit mask is 0, times d * (6-bit scale - 32)."""
    low = _bit_planes(blocks[:, 32:96].unflatten(1, (2, 32)), 2, 0).flatten(1)
    minus_four = _bit_planes(~blocks[:, :32], 1, 2).flatten(1)
    q = (low.view(torch.int8) - minus_four.view(torch.int8)).unflatten(1, (16, 16))
    packed = blocks[:, 96:108]
    scales = torch.cat((packed[:, :8] & 0x0F, packed[:, :8] >> 4), dim=1)
    scales |= _bit_planes(packed[:, 8:12], 2, 4).flatten(1)
    scale = (_f16(blocks, 108) * (scales.view(torch.int8) - 32).float()).unsqueeze(-1)
    return q.float().mul_(scale).flatten(1)


def _iq4_levels(q: torch.Tensor) -> torch.Tensor:
    """The float32 level of each 4-bit index in q (uint8, any shape)."""
    return IQ4_LEVELS.to(q.device).index_select(0, q.flatten().int()).view(q.shape)


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    return _iq4_levels(_nibbles(blocks, 2, 18, 16).flatten(1)).mul_(_f16(blocks, 0))


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    """8 sub-blocks of 32 levels, each scaled by d * (6-bit scale - 32): low 4 bits from bytes 4:8 (two per byte),
    high 2 bits from the 16-bit word at bytes 2:4."""
    low = torch.stack((blocks[:, 4:8] & 0x0F, blocks[:, 4:8] >> 4), dim=2).flatten(1)
    high = _bit_planes(blocks[:, 2:4], 2, 4).transpose(1, 2).flatten(1)
    scale = (_f16(blocks, 0) * ((low | high).view(torch.int8) - 32).float()).unsqueeze(-1)
    levels = _iq4_levels(_nibbles(blocks, 8, 136, 16).flatten(1)).unflatten(1, (8, 32))
    return levels.mul_(scale).flatten(1)


DEQUANTIZERS = {
    T.F32: lambda blocks: blocks.view(torch.float32).clone(),
    T.F16: lambda blocks: blocks.view(torch.float16).float(),
    T.BF16: lambda blocks: blocks.view(torch.bfloat16).float(),
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q8_0: _q8_0,
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
    T.IQ4_NL: _iq4_nl,
    T.IQ4_XS: _iq4_xs,
}
SUPPORTED = frozenset(DEQUANTIZERS)


def dequantize(data: torch.Tensor, qtype: gguf.GGMLQuantizationType, shape: tuple[int, int]) -> torch.Tensor:
    """A 2-D GGUF tensor as float32 [rows, cols] (torch order: out_features, in_features), always a new tensor.

    `data` is the tensor's raw bytes, uint8 [rows, row bytes] as `GGUFReader` gives quantized and BF16 tensors (any
    contiguous shape holding the same bytes works); F32 / F16 tensors may also come typed (`GGUFReader` gives those
    as float32 / float16 arrays). Sizes are not checked here: `check_supported` does that once, at load.
    """
    type_size = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = data if data.dtype == torch.uint8 else data.contiguous().view(torch.uint8)
    return DEQUANTIZERS[qtype](raw.reshape(-1, type_size)).reshape(shape)


def check_supported(
    name: str, qtype: gguf.GGMLQuantizationType, shape: tuple[int, int], n_bytes: int | None = None
) -> None:
    """BadInput naming the tensor unless `dequantize` handles its type, its rows split into whole blocks and (when
    `n_bytes` is given) it holds exactly rows * cols / block size * type size bytes."""
    type_name = getattr(qtype, "name", str(qtype))
    if qtype not in SUPPORTED:
        supported = ", ".join(t.name for t in sorted(SUPPORTED))
        raise BadInput(f"{name}: GGUF type {type_name} is not supported (supported: {supported})")
    rows, cols = shape
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if cols % block_size:
        raise BadInput(f"{name}: {cols} columns are not a multiple of the {type_name} block size {block_size}")
    expected = rows * cols // block_size * type_size
    if n_bytes is not None and n_bytes != expected:
        raise BadInput(f"{name}: {n_bytes} bytes, but a {rows}x{cols} {type_name} tensor has {expected}")
