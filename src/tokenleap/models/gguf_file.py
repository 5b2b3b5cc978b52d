"""A GGUF file's metadata and tensor table, read in one pass; tensor bytes memory-mapped.

The format (llama.cpp's docs/gguf.md, version 2 and 3): magic "GGUF", version, tensor and
key-value counts, the key-value pairs (typed scalars, strings, arrays), the tensor infos (name,
dimensions fastest first, GGML type, offset), then the data, aligned to `general.alignment`.

Why not `gguf.GGUFReader`: it builds a numpy memmap view for every part of every field, so a
Llama 3 file's 128k-token vocabulary and 280k merges take 10-20 s to parse (most of a 1B model's
load time). Here strings are decoded straight from the mapped bytes and numeric arrays are one
`np.frombuffer`, ~100x faster; tensors are read-only views of one mapping of the file, so no byte is
copied until a loader reads it. `gguf` (the package) still names the types and block sizes.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tokenleap.errors import TokenleapError

# GGUF metadata value types -> struct formats (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_ARRAY_DTYPES = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"
}
_FLOAT_DTYPES = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}


@dataclass(frozen=True)
class GgufTensor:
    """One tensor: `shape` in GGUF's order (fastest dimension first, as gguf-py gives it) and
    `data` a read-only view of the mapped file: typed `[rows, cols]` for F32 / F16, else the
    raw bytes `[rows, bytes per row]` (what `gguf.quants.dequantize` reads)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: gguf.GGMLQuantizationType
    data: np.ndarray
    offset: int  # of its bytes in the file


class _Cursor:
    """Little-endian reads from a buffer at a moving offset."""

    def __init__(self, buf: Any, offset: int = 0) -> None:
        self.buf, self.pos = buf, offset

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        (n,) = struct.unpack_from("<Q", self.buf, self.pos)
        start = self.pos + 8
        self.pos = start + n
        return bytes(self.buf[start : self.pos]).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == 8:
            return self.string()
        if vtype == 9:
            itype, count = self.scalar("<I"), self.scalar("<Q")
            if itype == 8:
                return [self.string() for _ in range(count)]
            if itype in _ARRAY_DTYPES:
                dtype = np.dtype(_ARRAY_DTYPES[itype])
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
                self.pos += count * dtype.itemsize
                return arr
            return [self.value(itype) for _ in range(count)]  # arrays of arrays
        if vtype not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return self.scalar(_SCALARS[vtype])


class GgufFile:
    """`fields` (key -> Python value: str, int, float, bool or list) and `tensors` (in file order)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            if bytes(self._map[:4]) != b"GGUF":
                raise ValueError("no GGUF magic")
            cur = _Cursor(self._map, 4)
            version = cur.scalar("<I")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (2 and 3 are read)")
            n_tensors, n_fields = cur.scalar("<Q"), cur.scalar("<Q")
            self.fields: dict[str, Any] = {}
            for _ in range(n_fields):
                key = cur.string()
                self.fields[key] = cur.value(cur.scalar("<I"))
            infos = []
            for _ in range(n_tensors):
                name = cur.string()
                dims = tuple(cur.scalar("<Q") for _ in range(cur.scalar("<I")))
                infos.append((name, dims, gguf.GGMLQuantizationType(cur.scalar("<I")), cur.scalar("<Q")))
            align = int(self.fields.get("general.alignment", 32))
            start = -(-cur.pos // align) * align
            data = np.frombuffer(self._map, dtype=np.uint8)  # read-only, shares the mapping
            self.tensors = [self._tensor(data, start, *info) for info in infos]
        except (ValueError, struct.error, IndexError, OSError) as exc:
            raise TokenleapError(f"{self.path} is not a readable GGUF file: {exc}") from exc

    @staticmethod
    def _tensor(
        data: np.ndarray, start: int, name: str, dims: tuple[int, ...], qtype: gguf.GGMLQuantizationType, offset: int
    ) -> GgufTensor:
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        cols = dims[0] if dims else 1
        rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
        row_bytes = cols // block * block_bytes
        raw = data[start + offset : start + offset + rows * row_bytes]
        if raw.size != rows * row_bytes:
            raise ValueError(f"tensor {name} runs past the end of the file")
        view = (
            raw.view(_FLOAT_DTYPES[qtype]).reshape(rows, cols)
            if qtype in _FLOAT_DTYPES
            else raw.reshape(rows, row_bytes)
        )
        return GgufTensor(name, dims, qtype, view, start + offset)

    def release(self, tensor: GgufTensor) -> None:
        """Drop a tensor's pages from this process's resident memory (the page cache keeps them;
        reading the tensor again faults them back in): a loader that has copied a tensor calls
        this, so a load's peak stays about the size of what it keeps, not that plus the file."""
        page = mmap.PAGESIZE
        start = tensor.offset // page * page
        end = -(-(tensor.offset + tensor.data.nbytes) // page) * page
        if hasattr(self._map, "madvise") and end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, min(end, len(self._map)) - start)
