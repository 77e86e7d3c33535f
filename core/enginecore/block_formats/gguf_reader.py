"""A GGUF file's metadata and tensor table, read without its token tables.

gguf's ``GGUFReader`` parses every field into numpy views of a mapping of the file, the
tokenizer's tables of strings included, which is slow for a tokenizer's tables of tens of
thousands of strings (benchmarks/RESULTS.md, "Other measurements behind the code"). The
engine needs the scalar fields and the tensor table; tokenizers are converted by
transformers, once per file. This reader walks the same header (the GGUF format, versions
2 and 3, either byte order) and keeps a string array as its length only. Numeric arrays
are kept as arrays. A tensor's bytes are read from the file
when asked for (``GGUFTensor.data``), or seen through a private mapping of the file
(``GGUFMetadata.mapped``), which reads nothing until a page is touched: the loader hands
quantized projections over mapped, so a linear method that finds them prepared already
(the CPU's prepared-weight cache) never reads them.
"""

from __future__ import annotations

import os
import pathlib
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
# GGUF's value types (gguf.GGUFValueType) other than STRING and ARRAY: struct and numpy codes.
SCALAR_TYPES = {
    0: ("B", "u1"),
    1: ("b", "i1"),
    2: ("H", "u2"),
    3: ("h", "i2"),
    4: ("I", "u4"),
    5: ("i", "i4"),
    6: ("f", "f4"),
    7: ("?", "?"),
    10: ("Q", "u8"),
    11: ("q", "i8"),
    12: ("d", "f8"),
}
# Tensor types held as numbers (gguf's reader gives these typed arrays; the rest bytes).
NUMERIC_TENSOR_TYPES = {"F16": "f2", "F32": "f4", "F64": "f8", "I8": "i1", "I16": "i2"}
NUMERIC_TENSOR_TYPES |= {"I32": "i4", "I64": "i8"}


@dataclass(frozen=True)
class SkippedStrings:
    """A string array this reader does not keep (a tokenizer's table): its length."""

    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class GGUFTensor:
    """One entry of the tensor table, with the fields of gguf's ``ReaderTensor``."""

    path: str
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    n_elements: int
    n_bytes: int
    data_offset: int
    byte_order: str

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes, read now, shaped as gguf's reader shapes them: numbers
        for float and integer types, else [rows..., bytes per row] of uint8."""
        import gguf

        dims = tuple(reversed(self.shape))
        typed = NUMERIC_TENSOR_TYPES.get(self.tensor_type.name)
        if typed is None:
            dtype = np.dtype(np.uint8)
            dims = gguf.quant_shape_to_byte_shape(dims, self.tensor_type)
        else:
            dtype = np.dtype(self.byte_order + typed)
        data = np.empty(dims, dtype=dtype)
        raw = memoryview(data.reshape(-1).view(np.uint8).data)
        with open(self.path, "rb", buffering=0) as file:
            file.seek(self.data_offset)
            done = 0
            while done < len(raw):
                got = file.readinto(raw[done:])
                if not got:
                    raise ValueError(f"{self.path}: the file ends inside tensor {self.name!r}")
                done += got
        return data


class GGUFMetadata:
    """``fields`` (key -> value: a Python scalar or str, a numpy array for a numeric array,
    :class:`SkippedStrings` for a string array) and ``tensors`` of a GGUF file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        import gguf

        self.path = str(pathlib.Path(path).resolve())
        self._mapping: torch.Tensor | None = None
        with open(self.path, "rb") as file:
            header = _Header(file)
            if header.take(4) != MAGIC:
                raise ValueError(f"{self.path} is not a GGUF file (no GGUF magic)")
            (version,) = header.unpack("I")
            if version & 0xFFFF == 0:  # written on a machine of the other byte order
                header.order = ">"
                version = struct.unpack(">I", struct.pack("<I", version))[0]
            if version not in VERSIONS:
                raise ValueError(f"{self.path}: GGUF version {version} is not supported")
            tensor_count, field_count = header.unpack("QQ")
            self.fields: dict[str, Any] = {}
            for _ in range(field_count):
                key = header.string()
                self.fields[key] = header.value(*header.unpack("I"))
            table = []
            for _ in range(tensor_count):
                name = header.string()
                (n_dims,) = header.unpack("I")
                dims = header.unpack("Q" * n_dims)
                raw_type, offset = header.unpack("IQ")
                table.append((name, dims, raw_type, offset))
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{self.path}: alignment {alignment} is not a power of two")
        start = -(-header.position // alignment) * alignment
        self.tensors: list[GGUFTensor] = []
        for name, dims, raw_type, offset in table:
            kind = gguf.GGMLQuantizationType(raw_type)
            block, size = gguf.GGML_QUANT_SIZES[kind]
            count = int(np.prod(dims)) if dims else 1
            self.tensors.append(
                GGUFTensor(
                    self.path,
                    name,
                    kind,
                    tuple(dims),
                    count,
                    count * size // block,
                    start + offset,
                    header.order,
                )
            )

    def mapped(self, tensor: GGUFTensor) -> torch.Tensor:
        """``tensor``'s bytes [rows..., bytes per row] (uint8) in a copy-on-write mapping of
        the file: nothing is read until used, and writes never reach the file."""
        import gguf

        if tensor.tensor_type.name in NUMERIC_TENSOR_TYPES:
            raise ValueError(f"{tensor.name} is a {tensor.tensor_type.name} tensor, not blocks")
        if self._mapping is None:
            size = os.path.getsize(self.path)
            self._mapping = torch.from_file(self.path, shared=False, size=size, dtype=torch.uint8)
        end = tensor.data_offset + tensor.n_bytes
        if end > self._mapping.numel():
            raise ValueError(f"{self.path}: the file ends inside tensor {tensor.name!r}")
        dims = gguf.quant_shape_to_byte_shape(tuple(reversed(tensor.shape)), tensor.tensor_type)
        return self._mapping[tensor.data_offset : end].view(dims)

    def unmap(self) -> None:
        """Drop this reader's mapping (tensors taken from it keep theirs alive)."""
        self._mapping = None

    def vocab_size(self) -> int:
        """The model's vocabulary: ``{architecture}.vocab_size``, else the length of the
        token table."""
        arch = self.field("general.architecture")
        return int(self.field(f"{arch}.vocab_size") or len(self.field("tokenizer.ggml.tokens", ())))

    def field(self, key: str, default: Any = None) -> Any:
        """A field's value as gguf's ``ReaderField.contents()`` gives it (a numeric array
        as a list); ``default`` when the file has no such field."""
        value = self.fields.get(key, default)
        return value.tolist() if isinstance(value, np.ndarray) else value


class _Header:
    """Reads the header in order, from a file read in chunks."""

    CHUNK = 1 << 20

    def __init__(self, file: Any) -> None:
        self.file = file
        self.buffer = bytearray()
        self.position = 0
        self.order = "<"

    def _have(self, n: int) -> None:
        while len(self.buffer) < self.position + n:
            chunk = self.file.read(max(self.CHUNK, n))
            if not chunk:
                raise ValueError("the GGUF header is cut short")
            self.buffer += chunk

    def take(self, n: int) -> bytes:
        self._have(n)
        taken = bytes(self.buffer[self.position : self.position + n])
        self.position += n
        return taken

    def unpack(self, layout: str) -> tuple[Any, ...]:
        layout = self.order + layout
        size = struct.calcsize(layout)
        self._have(size)
        values = struct.unpack_from(layout, self.buffer, self.position)
        self.position += size
        return values

    def string(self) -> str:
        (length,) = self.unpack("Q")
        return self.take(length).decode("utf-8")

    def value(self, kind: int) -> Any:
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item_kind, count = self.unpack("IQ")
            if item_kind == STRING:
                length = struct.Struct(self.order + "Q")
                for _ in range(count):
                    self._have(8)
                    self.position += 8 + length.unpack_from(self.buffer, self.position)[0]
                self._have(0)
                return SkippedStrings(count)
            if item_kind == ARRAY:
                return [self.value(ARRAY) for _ in range(count)]
            dtype = np.dtype(self.order + SCALAR_TYPES[item_kind][1])
            raw = self.take(dtype.itemsize * count)
            return np.frombuffer(raw, dtype=dtype).copy()
        if kind not in SCALAR_TYPES:
            raise ValueError(f"unknown GGUF value type {kind}")
        (scalar,) = self.unpack(SCALAR_TYPES[kind][0])
        return scalar
