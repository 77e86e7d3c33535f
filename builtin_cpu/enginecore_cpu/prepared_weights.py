"""Quantized weights prepared once per GGUF file and CPU, kept on disk and mapped back.

The ``gguf`` linear method multiplies blocks in its own layout (``block_formats``), which
takes a pass over every weight to make from a file's. That pass runs once: its result,
each layer's row ranges of blocks, is written here (and so is the float table of
a token embedding the file holds in blocks, looked up row by row), and later loads map it (copy-on-write,
nothing read until the kernels touch a page), so a warm load reads no weight and resident
memory grows with what the model uses, as with a mapped GGUF file.

Entries live under the kernel cache directory, in one directory per (GGUF file: resolved
path, size, modification time, inode and change time; CPU: model name and flags; the
block layouts' source and the C code that writes them), one
file per layer, named by the checkpoint rows the layer holds (:attr:`QuantizedTensor.source`).
A changed file, another CPU or a new layout finds another directory. An entry is written
to a temporary file and renamed, so a reader never sees half of one; a first load's C
pass fills the temporary file in place (:meth:`PreparedWeights.reserve`) rather than
preparing the layer in memory and writing it; an entry that does
not parse (cut short, another format, another layer's) is a miss, and the layer is
prepared and written again.

Entry format: ``MAGIC``, the header's length (8 bytes) and CRC-32 (4 bytes), the header
(JSON: the layer's key, the data's length, and per part its kind, format, shape and its
tensors' dtype, shape and offset), then from the next 64-byte boundary each tensor's
bytes, each at a 64-byte boundary. The values themselves carry no checksum: checking one
would read every weight at each load.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import struct
import tempfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch

from enginecore.block_formats import gguf_blocks, kquant_blocks
from enginecore.block_formats.gguf_blocks import BlockWeight
from enginecore.block_formats.kquant_blocks import KQuantWeight
from enginecore.block_formats.parts import Part
from enginecore_cpu import cpu_kernels, host_memory, kquant_kernels

logger = logging.getLogger(__name__)

ENV_SWITCH = "ENGINECORE_PREPARED_WEIGHTS"
MAGIC = b"ECPREP01"
_PREFIX = struct.Struct("<8sQI")  # magic, header length, header CRC-32
_ALIGN = 64
_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.uint8, torch.int8, torch.float16, torch.float32)
}

Layer = list[tuple[int, Part]]  # (first output row, blocks), in row order
_Entry = list[tuple[int, Part | torch.Tensor]]  # a layer, or one float table at row 0


def root() -> Path:
    """Where every file's prepared weights live: beside the compiled kernels."""
    return cpu_kernels.cache_dir() / "prepared_weights"


def cpu_identity() -> str:
    """The CPU's model name and feature flags, as /proc/cpuinfo gives them (and the level
    ``ENGINECORE_CPU_ISA`` chooses, where set)."""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line for line in f if line.startswith("model name")), "")
    except OSError:
        model = ""
    identity = model.strip() + "\n" + cpu_kernels._cpu_signature().strip()
    # a level chosen by ENGINECORE_CPU_ISA is another CPU's: its own entries
    return identity + f"\n{cpu_kernels.instruction_set()}" if cpu_kernels.isa_chosen() else identity


# The C sources that write an entry's bytes on a first load: the layers' repacking pass
# (``kquant_kernels.c``) and the table's de-quantization (``quant_kernels.c``).
ENTRY_WRITERS = [Path(__file__).with_name(n) for n in ("kquant_kernels.c", "quant_kernels.c")]


def _layout_signature() -> bytes:
    """The block layouts' source and the C code that writes them: a change to either
    starts a new cache (a fixed repacking pass never serves the entries of the old one)."""
    sources = [Path(gguf_blocks.__file__), Path(kquant_blocks.__file__), Path(__file__)]
    return b"".join(hashlib.sha256(s.read_bytes()).digest() for s in sources + ENTRY_WRITERS)


class PreparedWeights:
    """The prepared-weight cache of one GGUF file on this CPU."""

    def __init__(self, gguf_path: str | os.PathLike[str], cpu: str | None = None) -> None:
        path = Path(gguf_path).resolve()
        stat = path.stat()
        cpu = cpu or cpu_identity()
        key = hashlib.sha256()
        # The inode and the change time as well as the modification time: another file
        # moved or copied in under the same name, size and modification time (`cp -p`,
        # `rsync -a`, a tar) has another of either, and is never served this one's entry.
        file = (path, stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns)
        # the layouts of Q5_K's and Q6_K's high bits: a cache written by one build is
        # never read by a build that reads another
        high = f"Q5_K high bits: {kquant_kernels.q5_high()}, Q6_K: {kquant_kernels.q6_high()}"
        for item in (*map(str, file), cpu, high):
            key.update(item.encode() + b"\0")
        key.update(_layout_signature())
        self.directory = root() / key.hexdigest()[:24]
        # Which file on which CPU the directory serves: a new one replaces older ones.
        self._origin = f"{path}\0{hashlib.sha256(cpu.encode()).hexdigest()[:24]}"
        self._writable = True  # until a write fails: then one warning, no more tries

    @staticmethod
    def enabled() -> bool:
        return not cpu_kernels.switched_off(ENV_SWITCH)

    def _replace_older(self) -> None:
        """Start this file's directory, removing those of its earlier versions (another
        modification time or block layout) and those of files that no longer exist;
        other files' and other CPUs' stay."""
        import shutil

        for other in root().glob("*/origin"):
            with contextlib.suppress(OSError, ValueError):
                origin = other.read_text()
                gone = not Path(origin.split("\0")[0]).exists()
                if (origin == self._origin or gone) and other.parent != self.directory:
                    shutil.rmtree(other.parent, ignore_errors=True)
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "origin").write_text(self._origin)

    def _entry(self, key: str) -> Path:
        return self.directory / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".bin")

    def load(self, key: str) -> Layer | None:
        """The layer prepared under ``key``, mapped from disk; None when there is no
        entry or it does not parse (the caller prepares the layer and saves it again)."""
        return _layer_of(self._load(key, streamed=True))

    def load_table(self, key: str) -> torch.Tensor | None:
        """The float table kept under ``key`` (a token embedding's), mapped from disk
        for rows looked up at random."""
        return _table_of(self._load(key, streamed=False))

    def save_table(self, key: str, table: torch.Tensor) -> None:
        """Keep ``table`` under ``key``; a failure to write only costs the next load time."""
        self._save(key, [(0, table)])

    def save(self, key: str, layer: Layer) -> None:
        """Write ``layer`` under ``key``; a failure to write only costs the next load time."""
        self._save(key, list(layer))

    def _load(self, key: str, streamed: bool) -> _Entry | None:
        path = self._entry(key)
        try:
            size = path.stat().st_size
            if size < _PREFIX.size:
                raise ValueError("the header is cut short")
            data = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
            # Advised before a page is read, and the header read through the mapping too:
            # a read() would bring the first pages into small page-cache folios.
            host_memory.advise_reads(data, streamed)
            magic, length, crc = _PREFIX.unpack(data[: _PREFIX.size].numpy().tobytes())
            fits = magic == MAGIC and length < size
            raw = data[_PREFIX.size : _PREFIX.size + length].numpy().tobytes() if fits else b""
            if len(raw) != length or zlib.crc32(raw) != crc:
                raise ValueError("the header is cut short or damaged")
            header = json.loads(raw)
            base = _aligned(_PREFIX.size + length)
            if header["key"] != key or base + int(header["data"]) != size:
                raise ValueError("the entry is another layer's or cut short")
            data = data[base:]
            return [(int(p["first"]), _part(p, data)) for p in header["parts"]]
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, RuntimeError, ValueError, KeyError, TypeError, struct.error) as exc:
            # RuntimeError: torch.from_file's, where the file cannot be mapped
            logger.warning("prepared weights in %s unreadable (%s); preparing again", path, exc)
            return None

    def _new_entry(self, raw: bytes) -> tuple[BinaryIO, str]:
        """A new entry's temporary file, named by this process, open with ``raw`` (its
        prefix and header) written; those of processes that died while writing one (a
        reserved entry is the layer's full size) are removed."""
        if not self.directory.is_dir():
            self._replace_older()
        for stale in self.directory.glob("*.tmp"):
            pid = stale.name.split("-", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                stale.unlink(missing_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f"{os.getpid()}-", suffix=".tmp")
        f = os.fdopen(fd, "wb")
        try:
            f.write(raw)
        except BaseException:
            f.close()
            Path(tmp).unlink(missing_ok=True)
            raise
        return f, tmp

    def reserve(
        self, key: str, layer: Sequence[tuple[int, Part | torch.Tensor]]
    ) -> ReservedEntry | None:
        """Room for ``layer`` in a new entry, to be filled in place: ``layer``'s tensors
        give only their dtypes and shapes (they may be on the ``meta`` device; a float
        table is one tensor at row 0). The
        preparation pass writes its result straight into the entry's pages (no copy
        in memory, no second write); None where nothing can be written (prepare in
        memory then)."""
        if not self._writable or not hasattr(os, "posix_fallocate"):  # macOS has none
            return None
        raw, end, _ = _header(key, list(layer))
        base = _aligned(_PREFIX.size + len(raw))
        try:
            # The header goes in through the mapping too: written to the file first, it
            # would take the first pages in small page-cache folios.
            f, tmp = self._new_entry(b"")
            try:
                with f:
                    f.flush()
                    # Blocks allocated now: a full disk is an error here, where a sparse
                    # file's pages would fault (SIGBUS) as the pass wrote them.
                    try:
                        os.posix_fallocate(f.fileno(), 0, base + end)
                    except OSError as exc:
                        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                            raise
                        Path(tmp).unlink(missing_ok=True)
                        return None  # a file system without it: written from memory
                data = torch.from_file(tmp, shared=True, size=base + end, dtype=torch.uint8)
                # The pass fills huge page-cache folios for a layer, small ones for a table.
                host_memory.advise_reads(data, streamed=_table_of(layer) is None)
                head = _prefixed(raw)
                data[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
                header = json.loads(raw)
                parts = [(int(p["first"]), _part(p, data[base:])) for p in header["parts"]]
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except (OSError, RuntimeError) as exc:
            self._writable = False
            logger.warning("could not keep prepared weights in %s: %s", self.directory, exc)
            return None
        return ReservedEntry(self, key, Path(tmp), parts)

    def _save(self, key: str, layer: _Entry) -> None:
        if not self._writable:
            return
        raw, end, writes = _header(key, layer)
        base = _aligned(_PREFIX.size + len(raw))
        try:
            f, tmp = self._new_entry(_prefixed(raw))
            try:
                with f:
                    for t, offset in writes:
                        f.write(b"\0" * (base + offset - f.tell()))
                        f.write(t.contiguous().view(torch.uint8).reshape(-1).numpy().data)
                    f.write(b"\0" * (base + end - f.tell()))
                os.replace(tmp, self._entry(key))
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as exc:
            self._writable = False
            logger.warning("could not keep prepared weights in %s: %s", self.directory, exc)


class ReservedEntry:
    """An entry being filled in place (:meth:`PreparedWeights.reserve`): ``layer``'s
    tensors (or ``table``) are views of the new entry's shared mapping; :meth:`commit`
    (or :meth:`commit_table`) publishes it."""

    def __init__(self, owner: PreparedWeights, key: str, path: Path, entry: _Entry) -> None:
        self.owner, self.key, self.path = owner, key, path
        self._filled: _Entry | None = entry

    @property
    def layer(self) -> Layer | None:
        """The layer's parts to fill; None once published or dropped, or for a table."""
        return _layer_of(self._filled)

    @property
    def table(self) -> torch.Tensor | None:
        """The float table to fill; None once published or dropped, or for a layer."""
        return _table_of(self._filled)

    def _publish(self) -> bool:
        self._filled = None
        try:
            os.replace(self.path, self.owner._entry(self.key))
        except OSError as exc:
            self.path.unlink(missing_ok=True)
            logger.warning("could not keep prepared weights in %s: %s", self.path.parent, exc)
            return False
        return True

    def commit(self) -> Layer | None:
        """Publish the filled entry (renamed into place, as a write is) and map it back
        as a warm load does; the caller drops its views of the shared mapping."""
        return self.owner.load(self.key) if self._publish() else None

    def commit_table(self) -> torch.Tensor | None:
        """:meth:`commit` for a float table."""
        return self.owner.load_table(self.key) if self._publish() else None

    def abort(self) -> None:
        """Drop an entry whose filling failed."""
        self._filled = None
        self.path.unlink(missing_ok=True)


def _header(key: str, layer: _Entry) -> tuple[bytes, int, list[tuple[torch.Tensor, int]]]:
    """An entry's header for ``layer``, its data's length, and each tensor's offset."""
    writes: list[tuple[torch.Tensor, int]] = []
    parts = []
    end = 0  # offsets count from the first 64-byte boundary after the header
    for first, part in layer:
        specs = []
        for t in _fields(part):
            dtype = str(t.dtype).removeprefix("torch.")
            specs.append({"dtype": dtype, "shape": list(t.shape), "offset": end})
            writes.append((t, end))
            end = _aligned(end + t.numel() * t.element_size())
        parts.append({**_describe(part), "first": first, "tensors": specs})
    return json.dumps({"key": key, "parts": parts, "data": end}).encode(), end, writes


def _layer_of(entry: _Entry | None) -> Layer | None:
    """``entry`` if it holds a layer's parts, else None."""
    if entry is None or not all(isinstance(p, BlockWeight | KQuantWeight) for _, p in entry):
        return None
    return cast(Layer, entry)


def _table_of(entry: Sequence[tuple[int, Part | torch.Tensor]] | None) -> torch.Tensor | None:
    """``entry``'s float table if it is one (one tensor at row 0), else None."""
    if entry is None or len(entry) != 1 or not isinstance(entry[0][1], torch.Tensor):
        return None
    return entry[0][1]


def _prefixed(raw: bytes) -> bytes:
    """An entry's first bytes: ``MAGIC``, the header's length and CRC-32, the header."""
    return _PREFIX.pack(MAGIC, len(raw), zlib.crc32(raw)) + raw


def _alive(pid: int) -> bool:
    if os.name != "posix":
        return True  # signal 0 only probes a process on POSIX systems
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _fields(part: Part | torch.Tensor) -> list[torch.Tensor]:
    if isinstance(part, torch.Tensor):
        return [part]
    if isinstance(part, KQuantWeight):
        return [part.qs, part.scales]
    return [part.qs, part.d, part.m]


def _describe(part: Part | torch.Tensor) -> dict[str, Any]:
    if isinstance(part, torch.Tensor):
        return {"kind": "table", "shape": list(part.shape)}
    if isinstance(part, KQuantWeight):
        return {"kind": "kquant", "fmt": part.fmt, "shape": list(part.shape), "high": part.high}
    return {
        "kind": "blocks",
        "bits": part.bits,
        "shape": list(part.shape),
        "symmetric": part.symmetric,
    }


def _tensor(spec: dict[str, Any], data: torch.Tensor) -> torch.Tensor:
    dtype = _DTYPES[spec["dtype"]]
    shape = [int(n) for n in spec["shape"]]
    count = 1
    for n in shape:
        count *= n
    start = int(spec["offset"])
    end = start + count * dtype.itemsize
    if start % _ALIGN or end > data.numel():
        raise ValueError("a tensor lies outside the entry")
    return data[start:end].view(dtype).view(shape)


def _part(spec: dict[str, Any], data: torch.Tensor) -> Part | torch.Tensor:
    shape = (int(spec["shape"][0]), int(spec["shape"][1]))
    fields = [_tensor(t, data) for t in spec["tensors"]]
    if spec["kind"] == "table":
        (table,) = fields
        if tuple(table.shape) != shape:
            raise ValueError("a table's shape differs from its part's")
        return table
    if spec["kind"] == "kquant":
        qs, scales = fields
        high = str(spec.get("high", kquant_blocks.PLANES))
        return KQuantWeight(str(spec["fmt"]), qs, scales, shape, high)
    qs, d, m = fields
    return BlockWeight(int(spec["bits"]), qs, d, m, shape, bool(spec.get("symmetric", False)))
