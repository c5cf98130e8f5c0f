"""A GGUF file's metadata and tensor table, read in one pass; tensor data memory-mapped.

Why not `gguf.GGUFReader`: it builds a numpy view for every element of every metadata array, so a
Qwen2 file's 151,936-token vocabulary (three such arrays) took about 2.5 s of a 6 s start-up
on a 2-core machine. The engine needs the scalars, the tensor table and the mapped data only
(the tokenizer is read elsewhere, once, and cached): arrays are skipped by their lengths, and
only short ones (under `_KEEP_ARRAYS` elements) are kept as lists. The format: GGUF v2/v3,
little-endian (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md).
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_KEEP_ARRAYS = 64
_DEFAULT_ALIGNMENT = 32


class GGUFTensorEntry(NamedTuple):
    """One tensor: `shape` innermost first (as the file lists it), `data` a read-only view of the
    mapped file in numpy order (quantized types: uint8 `[..., row bytes]`)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class GGUFIndex(NamedTuple):
    fields: dict[str, Any]
    tensors: list[GGUFTensorEntry]


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        value = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return value

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise ValueError(f"GGUF: unknown metadata value type {vtype}")
        etype, count = self.unpack("<I"), self.unpack("<Q")
        if count <= _KEEP_ARRAYS:
            return [self.value(etype) for _ in range(count)]
        if etype in _SCALARS:  # skipped by its length
            self.pos += count * struct.calcsize(_SCALARS[etype])
        elif etype == _STRING:
            for _ in range(count):
                self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]
        else:
            for _ in range(count):
                self.value(etype)
        return None  # a long array: not kept


def read_gguf_index(path: str) -> GGUFIndex:
    """The metadata scalars (and short arrays) and the tensor table of the GGUF file at `path`."""
    mapped = np.memmap(path, mode="r", dtype=np.uint8)
    cur = _Cursor(memoryview(mapped))
    if bytes(mapped[:4]) != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are; a big-endian file "
                         "reads as a huge version number)")
    n_tensors, n_fields = cur.unpack("<Q"), cur.unpack("<Q")
    fields: dict[str, Any] = {}
    for _ in range(n_fields):
        key = cur.string()
        fields[key] = cur.value(cur.unpack("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.unpack("<Q") for _ in range(cur.unpack("<I")))
        infos.append((name, GGMLQuantizationType(cur.unpack("<I")), dims, cur.unpack("<Q")))
    alignment = int(fields.get("general.alignment", _DEFAULT_ALIGNMENT))
    start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, ttype, dims, offset in infos:
        block, size = GGML_QUANT_SIZES[ttype]
        count = int(np.prod(dims)) if dims else 1
        nbytes = count // block * size
        raw = mapped[start + offset:start + offset + nbytes]
        numpy_shape = tuple(reversed(dims))
        if ttype.name == "F32":
            data = raw.view(np.float32).reshape(numpy_shape)
        elif ttype.name == "F16":
            data = raw.view(np.float16).reshape(numpy_shape)
        else:  # BF16 and the block types: bytes per row
            data = raw.reshape(*numpy_shape[:-1], numpy_shape[-1] // block * size)
        tensors.append(GGUFTensorEntry(name, ttype, dims, data))
    return GGUFIndex(fields, tensors)
