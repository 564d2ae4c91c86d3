"""A GGUF file's tensor table, read without building its metadata values.

`gguf.GGUFReader` turns every metadata value into Python objects; for Gemma 3's 262,144-token vocabulary that is
close to a gigabyte for the moment it takes. Building a packed base needs only the architecture, the alignment and
where each tensor lies, so this walks the header with offsets alone (string arrays are skipped by their lengths)
and maps the tensor data read-only. The layout is the GGUF spec's (version 2 and 3): magic, version, tensor count,
key-value count, the key-value pairs, the tensor infos, then the data at the alignment.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from ...errors import BadInput

V = gguf.GGUFValueType
# the struct format of each fixed-size value type
FORMATS = {
    V.UINT8: "<B",
    V.INT8: "<b",
    V.BOOL: "<?",
    V.UINT16: "<H",
    V.INT16: "<h",
    V.UINT32: "<I",
    V.INT32: "<i",
    V.FLOAT32: "<f",
    V.UINT64: "<Q",
    V.INT64: "<q",
    V.FLOAT64: "<d",
}
FIXED = {kind: struct.calcsize(fmt) for kind, fmt in FORMATS.items()}
# numpy's view of the dense types; every block format is raw bytes
DENSE = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as `gguf.ReaderTensor` describes it: `shape` lists ne0 (the columns) first; `data` is a read-only
    view of the file shaped as the reader shapes it: [..., rows, row bytes] uint8 for block formats and BF16,
    typed [..., rows, cols] for F32 / F16 (a 1-D tensor: [cols])."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data_offset: int
    n_bytes: int
    data: np.ndarray


class GgufIndex:
    """The tensors of a GGUF file by name, `architecture`, its scalar metadata (`fields`: numbers, booleans and
    strings by key; arrays are skipped), and the file's memory map (`file_map`)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        with self.path.open("rb") as handle:
            self.file_map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self.fields, self.tensors = self._read()
            self.architecture = str(self.fields["general.architecture"])
        except (struct.error, ValueError, KeyError) as exc:
            raise BadInput(f"model.name: {self.path} is truncated or damaged: {exc}".splitlines()[0]) from exc

    def _read(self) -> tuple[dict, dict[str, TensorEntry]]:
        self.at = 4
        version, n_tensors, n_kv = self._unpack("<I"), self._unpack("<Q"), self._unpack("<Q")
        if self.file_map[:4] != b"GGUF" or version not in (2, 3):
            raise ValueError(f"not a GGUF file of version 2 or 3 (version {version})")
        fields = {}
        for _ in range(n_kv):
            key, kind = self._string(), V(self._unpack("<I"))
            value = self._value(kind)
            if value is not None:
                fields[key] = value
        infos = [self._tensor_info() for _ in range(n_tensors)]
        alignment = fields.get("general.alignment") or gguf.GGUF_DEFAULT_ALIGNMENT
        start = -(-self.at // alignment) * alignment
        if "general.architecture" not in fields:
            raise ValueError("no general.architecture in its metadata")
        return fields, {info[0]: self._entry(start, *info) for info in infos}

    def _unpack(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.file_map, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def _string(self, keep: bool = True) -> str | None:
        length = self._unpack("<Q")
        raw = self.file_map[self.at : self.at + length] if keep else None
        self.at += length
        return None if raw is None else raw.decode("utf-8")

    def _value(self, kind: V, keep: bool = True):
        """A scalar value (None when not kept), or None after skipping an array."""
        if kind == V.STRING:
            return self._string(keep)
        if kind == V.ARRAY:
            item, count = V(self._unpack("<I")), self._unpack("<Q")
            if item in FIXED:
                self.at += FIXED[item] * count
            else:
                for _ in range(count):
                    self._value(item, keep=False)
            return None
        if keep:
            return self._unpack(FORMATS[kind])
        self.at += FIXED[kind]
        return None

    def _tensor_info(self) -> tuple[str, tuple[int, ...], gguf.GGMLQuantizationType, int]:
        name = self._string()
        dims = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
        return name, dims, gguf.GGMLQuantizationType(self._unpack("<I")), self._unpack("<Q")

    def _entry(self, start: int, name: str, dims: tuple[int, ...], qtype, offset: int) -> TensorEntry:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        cols, rows = dims[0], int(np.prod(dims[1:], dtype=np.int64))
        n_bytes = rows * cols // block_size * type_size
        begin = start + offset
        if begin + n_bytes > len(self.file_map):
            raise ValueError(f"tensor {name} ends at byte {begin + n_bytes}, past the file's {len(self.file_map)}")
        raw = np.frombuffer(self.file_map, np.uint8, n_bytes, begin)
        outer = tuple(reversed(dims[1:]))
        data = raw.view(DENSE[qtype]).reshape(*outer, cols) if qtype in DENSE else raw.reshape(*outer, -1)
        return TensorEntry(name, qtype, dims, begin, n_bytes, data)
