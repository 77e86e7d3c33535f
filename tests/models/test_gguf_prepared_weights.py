"""A GGUF file's blocks prepared once per file and CPU, kept on disk and mapped back;
prefill computed on the blocks themselves, with no float32 copy of a weight."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from enginecore.block_formats import gguf_blocks, kquant_blocks
from enginecore.block_formats.parts import dequantized_part, unpacked
from enginecore.distributed import SINGLE_RANK
from enginecore.layers.linear import RowParallelLinear, use_linear_method
from enginecore.layers.quantized import QuantizedTensor
from enginecore_cpu import gguf_linear_method, prepared_weights, quant_kernels
from enginecore_cpu.gguf_linear_method import DIRECT_MAX_ROWS, GGUFLinearMethod
from enginecore_cpu.host_memory import HUGE_PAGE, mappings_under
from enginecore_cpu.prepared_weights import PreparedWeights

gguf = pytest.importorskip("gguf")

needs_kernels = pytest.mark.skipif(quant_kernels.load() is None, reason="no C compiler")
FORMATS = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


# Byte offsets of each block's float16 fields (scales, minimums) in GGUF's layouts.
HALF_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2)}
HALF_OFFSETS["Q6_K"] = (208,)


def random_tensor(fmt: str, rows: int = 64, cols: int = 512, seed: int = 0) -> QuantizedTensor:
    """Random bytes in ``fmt``'s blocks, their float16 fields small finite numbers."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[fmt]]
    count = rows * cols // block
    data = rng.integers(0, 256, size=(count, size), dtype=np.uint8)
    for offset in HALF_OFFSETS[fmt]:
        halves = rng.uniform(1e-3, 2e-2, size=count).astype(np.float16)
        data[:, offset : offset + 2] = halves.view(np.uint8).reshape(count, 2)
    raw = torch.from_numpy(data.reshape(rows, -1))
    return QuantizedTensor(raw, fmt, (rows, cols))


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    root = tmp_path / "prepared"
    monkeypatch.setattr(prepared_weights, "root", lambda: root)
    return root


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_torch_dequantization_is_ggufs_bit_for_bit(fmt):
    """The loader de-quantizes embeddings in torch: the same float32 bits as gguf's numpy."""
    tensor = random_tensor(fmt)
    want = gguf.quants.dequantize(tensor.data.numpy(), gguf.GGMLQuantizationType[fmt])
    got = dequantized_part(unpacked(tensor)).numpy()
    assert np.array_equal(want.reshape(got.shape).view(np.uint32), got.view(np.uint32))


def assert_same_parts(got: list[tuple[int, Any]], want: list[tuple[int, Any]]) -> None:
    assert [first for first, _ in got] == [first for first, _ in want]
    for (_, mine), (_, theirs) in zip(got, want, strict=True):
        assert type(mine) is type(theirs) and mine.shape == theirs.shape
        assert mine.kind == theirs.kind
        assert getattr(mine, "high", None) == getattr(theirs, "high", None)
        for name in ("qs", "d", "m", "scales"):
            a, b = getattr(mine, name, None), getattr(theirs, name, None)
            if b is not None:
                assert a.dtype == b.dtype and a.shape == b.shape, name
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def test_prepared_weights_come_back_bit_for_bit_keyed_by_file_and_cpu(tmp_path, cache_root):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    layer = [(0, unpacked(random_tensor("Q4_0"))), (64, unpacked(random_tensor("Q6_K", 32)))]
    layer += [(96, unpacked(random_tensor("Q8_0", 16)))]
    # Q5_K's and Q6_K's high bits as the AVX2 build keeps them
    for first, fmt in ((112, "Q6_K"), (128, "Q5_K")):
        packed = random_tensor(fmt, 16, seed=1)
        part = kquant_blocks.from_gguf(packed.data, fmt, packed.shape, kquant_blocks.PACKED)
        layer += [(first, part)]
    cache = PreparedWeights(model, cpu="cpu A")
    assert cache.load("layer 0") is None
    cache.save("layer 0", layer)
    assert_same_parts(PreparedWeights(model, cpu="cpu A").load("layer 0"), layer)
    assert cache.load("layer 1") is None
    # another CPU's flags, or the file changed (its time, its size): another cache
    assert PreparedWeights(model, cpu="cpu B").load("layer 0") is None
    stat = model.stat()
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert PreparedWeights(model, cpu="cpu A").load("layer 0") is None
    PreparedWeights(model, cpu="cpu A").save("layer 0", layer)
    model.write_bytes(model.read_bytes() + b"\0")
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert PreparedWeights(model, cpu="cpu A").load("layer 0") is None
    # The file's new version replaces its older entries on this CPU, not another CPU's.
    PreparedWeights(model, cpu="cpu B").save("layer 0", layer)
    PreparedWeights(model, cpu="cpu A").save("layer 0", layer)
    kept = {p.parent for p in cache_root.glob("*/origin")}
    assert kept == {PreparedWeights(model, cpu=c).directory for c in ("cpu A", "cpu B")}
    # A file that no longer exists loses its entries when another file's are started.
    gone = tmp_path / "gone.gguf"
    gone.write_bytes(b"GGUF")
    PreparedWeights(gone, cpu="cpu A").save("layer 0", layer)
    gone.unlink()
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF")
    PreparedWeights(other, cpu="cpu A").save("layer 0", layer)
    kept = {p.parent for p in cache_root.glob("*/origin")}
    assert kept == {PreparedWeights(model, cpu=c).directory for c in ("cpu A", "cpu B")} | {
        PreparedWeights(other, cpu="cpu A").directory
    }


def test_another_file_under_the_same_name_size_and_time_is_not_served(tmp_path, cache_root):
    """A file put in place of the model, with its name, size and modification time (`cp
    -p`, `rsync -a` and tar keep the time), is another file: it is prepared again, never
    served the first one's entries, whether copied over it or moved in under its name."""
    import shutil
    import time

    model, other = tmp_path / "model.gguf", tmp_path / "other.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    layer = [(0, unpacked(random_tensor("Q4_0")))]
    for replace in ("copied over", "moved in"):
        PreparedWeights(model, cpu="cpu").save("layer 0", layer)
        assert PreparedWeights(model, cpu="cpu").load("layer 0") is not None
        stat = model.stat()
        time.sleep(0.05)  # a later clock tick: the file system's times are coarser than ns
        other.write_bytes(b"GGUF" + bytes(59) + b"\1")
        if replace == "copied over":
            shutil.copyfile(other, model)
        else:
            os.replace(other, model)
        os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert (model.stat().st_size, model.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
        assert PreparedWeights(model, cpu="cpu").load("layer 0") is None, replace


@pytest.mark.parametrize("writer", [0, 1])
def test_a_changed_repacking_pass_does_not_serve_the_old_entries(
    tmp_path, cache_root, monkeypatch, writer
):
    """The C code that writes an entry's bytes on a first load (the layers' repacking,
    the table's de-quantization) is part of the cache's key: entries a fixed pass would
    write differently are never served from the old pass's."""
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    layer = [(0, unpacked(random_tensor("Q4_0")))]
    PreparedWeights(model, cpu="cpu").save("layer 0", layer)
    assert PreparedWeights(model, cpu="cpu").load("layer 0") is not None
    sources = list(prepared_weights.ENTRY_WRITERS)
    changed = tmp_path / sources[writer].name
    changed.write_bytes(sources[writer].read_bytes() + b"\n/* a fix */\n")
    sources[writer] = changed
    monkeypatch.setattr(prepared_weights, "ENTRY_WRITERS", sources)
    assert PreparedWeights(model, cpu="cpu").load("layer 0") is None


@pytest.mark.parametrize("damage", ["header byte", "cut data", "cut header", "empty", "key"])
def test_a_damaged_entry_is_a_miss_and_is_written_again(tmp_path, cache_root, damage, caplog):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    layer = [(0, unpacked(random_tensor("Q4_K")))]
    cache = PreparedWeights(model, cpu="cpu")
    cache.save("layer", layer)
    (entry,) = cache.directory.glob("*.bin")
    raw = bytearray(entry.read_bytes())
    if damage == "header byte":
        raw[40] ^= 0xFF
    elif damage == "cut data":
        raw = raw[:-100]
    elif damage == "cut header":
        raw = raw[:30]
    elif damage == "empty":
        raw = bytearray()
    else:  # an entry that names another layer, under this one's name
        cache.save("other", layer)
        raw = bytearray(next(p for p in cache.directory.glob("*.bin") if p != entry).read_bytes())
    entry.write_bytes(bytes(raw))
    assert cache.load("layer") is None
    assert "preparing again" in caplog.text
    cache.save("layer", layer)
    assert_same_parts(cache.load("layer"), layer)


def test_an_unwritable_cache_warns_once_and_loads_as_without_it(tmp_path, cache_root, caplog):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    cache_root.parent.mkdir(exist_ok=True)
    cache_root.write_bytes(b"not a directory")  # every write under it fails
    cache = PreparedWeights(model, cpu="cpu")
    layer = [(0, unpacked(random_tensor("Q4_0")))]
    for name in ("a", "b", "c"):
        cache.save(name, layer)
        assert cache.load(name) is None
    assert caplog.text.count("could not keep prepared weights") == 1
    assert "unreadable" not in caplog.text  # no entry is a plain miss


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_prefill_step_runs_on_the_blocks_alone(fmt, monkeypatch):
    """A prefill-sized step multiplies the blocks as loaded: nothing de-quantized, for the
    call or for later (no float copy, no job in the background), within the activations'
    8-bit rounding of the weight the blocks stand for."""
    torch.manual_seed(0)
    method = GGUFLinearMethod(None)
    with use_linear_method(method):
        layer = RowParallelLinear(512, 96, bias=True, parallel=SINGLE_RANK, dtype=torch.float32)
    loaded = random_tensor(fmt, 96, 512)
    bias = torch.randn(96)
    params = dict(layer.named_parameters())
    params["weight"].weight_loader(params["weight"], loaded)
    params["bias"].weight_loader(params["bias"], bias)
    method.process_weights_after_loading(layer)

    def no_dequantizing(*args: Any) -> None:
        raise AssertionError("a weight was de-quantized for a prefill step")

    monkeypatch.setattr(gguf_linear_method, "_dequantize_with", no_dequantizing)
    x = torch.randn(DIRECT_MAX_ROWS + 40, 512)
    want = F.linear(x, dequantized_part(unpacked(loaded)), bias)
    got = layer(x)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-2
    assert layer.weight.numel() == 0  # the blocks alone, before and after the step
    assert [vars(layer)[k] for k in vars(layer) if "float" in k] == []


def _q4_k_m(name: str) -> str:
    """llama.cpp's Q4_K_M mix: V and the down projection in Q6_K, the rest in Q4_K."""
    return "Q6_K" if ("attn_v" in name or "ffn_down" in name) else "Q4_K"


@needs_kernels
def test_a_gguf_loads_from_its_prepared_weights_with_the_same_tokens(
    tiny_llama, tmp_path, cache_root, monkeypatch
):
    """Load without the cache (the weights prepared in memory), then twice with it: the
    first writes each layer's entry, the second maps them and prepares nothing. Greedy
    tokens are the same each time, a prefill-sized prompt's included. The last also
    leaves the q/k blocks in the file's rotary order (it never reads them)."""
    from enginecore import LLM, SamplingParams
    from tests.helpers.gguf_writer import write_gguf

    path = write_gguf(tiny_llama, tmp_path / "q4_k_m.gguf", types=_q4_k_m)
    prepared = []
    for name in ("_unpacked_runs", "_unpacked_in_place"):  # in memory, into the entry

        def counting_unpacked(*args, _original=getattr(gguf_linear_method, name)):
            prepared.extend(piece.source for piece in args[-1].values())
            return _original(*args)

        monkeypatch.setattr(gguf_linear_method, name, counting_unpacked)
    from enginecore_models import weight_loader

    reordered = []  # q/k blocks put in HF's rotary order: never on a warm load
    original_unpermute = weight_loader.unpermute_rope

    def counting_unpermute(raw, heads):
        reordered.append(heads)
        return original_unpermute(raw, heads)

    monkeypatch.setattr(weight_loader, "unpermute_rope", counting_unpermute)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 40))}, {"prompt_token_ids": list(range(5, 90))}]
    answers, unpacked_counts, reorder_counts = [], [], []
    for switch in ["0", "1", "1"]:
        monkeypatch.setenv(prepared_weights.ENV_SWITCH, switch)
        prepared.clear()
        reordered.clear()
        llm = LLM(str(path), multiprocessing=False)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            answers.append([o.outputs[0].token_ids for o in outs])
        finally:
            llm.shutdown()
        unpacked_counts.append(len(prepared))
        reorder_counts.append(len(reordered))
    assert answers[0] == answers[1] == answers[2], answers
    assert unpacked_counts[0] == unpacked_counts[1] > 0 and unpacked_counts[2] == 0
    assert reorder_counts[0] == reorder_counts[1] > 0 and reorder_counts[2] == 0
    assert len(list(cache_root.glob("*/*.bin"))) > 0


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
def test_an_embedding_in_blocks_comes_back_as_a_mapped_table(
    fmt, tmp_path, cache_root, monkeypatch, caplog
):
    """A GGUF file's token embedding in blocks becomes a float32 table kept beside the
    prepared weights, unpacked and de-quantized by the C kernels (not in torch) straight
    into its entry at the first load (no float copy in memory, no second write): the
    next load maps it and de-quantizes nothing, lookups give the bits of torch's
    de-quantized blocks, and a damaged entry is a miss, written again."""
    from enginecore.block_formats import parts
    from enginecore.layers.embedding import VocabParallelEmbedding

    source = tmp_path / "model.gguf"
    source.write_bytes(b"a GGUF file's stand-in: the cache keys on its path, size and time")
    raw = random_tensor(fmt, 64, 512)
    blocks = QuantizedTensor(raw.data, raw.format, raw.shape, "model.embed_tokens.weight")
    want = dequantized_part(unpacked(blocks))
    ids = torch.tensor([0, 5, 63, 5])

    def no_dequantizing(part):
        raise AssertionError("the embedding was de-quantized in torch")

    def load() -> VocabParallelEmbedding:
        method = GGUFLinearMethod(None)
        method.prepared = PreparedWeights(source)
        with use_linear_method(method):
            table = VocabParallelEmbedding(64, 512, parallel=SINGLE_RANK, dtype=torch.float32)
        table.weight.weight_loader(table.weight, blocks)
        return table

    def no_torch_pass(*args):
        raise AssertionError("the embedding's blocks were unpacked in torch")

    def no_copy(*args):
        raise AssertionError("the table was made in memory and written")

    with monkeypatch.context() as patch:
        patch.setattr(parts, "dequantized_part", no_dequantizing)
        patch.setattr(gguf_blocks, "from_gguf", no_torch_pass)
        patch.setattr(kquant_blocks, "from_gguf", no_torch_pass)
        patch.setattr(PreparedWeights, "_save", no_copy)
        first = load()
    assert torch.equal(first.weight, want) and torch.equal(first(ids), want[ids])
    entries = list(cache_root.glob("*/*.bin"))
    assert len(entries) == 1
    assert not list(cache_root.glob("*/*.tmp"))
    assert first.weight.untyped_storage().nbytes() == entries[0].stat().st_size  # mapped

    with monkeypatch.context() as patch:
        patch.setattr(parts, "dequantized_part", no_dequantizing)
        patch.setattr(gguf_linear_method, "_dequantized_table", no_dequantizing)
        warm = load()
    assert torch.equal(warm.weight, want) and torch.equal(warm(ids), want[ids])
    assert warm.weight.untyped_storage().nbytes() == entries[0].stat().st_size  # mapped

    entries[0].write_bytes(entries[0].read_bytes()[:200])  # cut short
    again = load()
    assert "unreadable" in caplog.text
    assert torch.equal(again.weight, want)
    assert entries[0].stat().st_size > 200  # written again


@needs_kernels
@pytest.mark.parametrize("fmt", ["Q4_0", "Q6_K"])
def test_a_first_load_computes_on_the_entries_it_wrote(fmt, tmp_path, cache_root):
    """A first load writes each layer's prepared blocks, then multiplies them mapped from
    the entry, as a warm load does: the copy it made is freed (kept, it was a second
    file-sized amount of resident memory until the process ended)."""
    source = tmp_path / "model.gguf"
    source.write_bytes(b"a GGUF file's stand-in: the cache keys on its path, size and time")
    raw = random_tensor(fmt, 96, 512)
    blocks = QuantizedTensor(raw.data, raw.format, raw.shape, "model.layers.0.mlp.down_proj")
    method = GGUFLinearMethod(None)
    method.prepared = PreparedWeights(source)
    with use_linear_method(method):
        layer = RowParallelLinear(512, 96, bias=False, parallel=SINGLE_RANK, dtype=torch.float32)
    layer.weight.weight_loader(layer.weight, blocks)
    method.process_weights_after_loading(layer)
    (entry,) = cache_root.glob("*/*.bin")
    parts = vars(layer)[gguf_linear_method._BLOCKS]
    tensors = [t for _, part in parts for t in prepared_weights._fields(part)]
    assert tensors and all(t.untyped_storage().nbytes() == entry.stat().st_size for t in tensors)
    x = torch.randn(3, 512)
    want = F.linear(x, dequantized_part(unpacked(blocks)))
    assert ((layer(x) - want).abs().max() / want.abs().max()).item() < 1e-2


@needs_kernels
def test_k_quant_layers_are_unpacked_straight_into_their_entries(tmp_path, cache_root, monkeypatch):
    """A first load unpacks a layer of K-quant blocks (Q4_K_M's QKV: Q4_K, Q4_K, Q6_K)
    into its new entry's pages, with no copy in memory and no second write, and computes
    on the entry mapped back: the bytes the torch pass and ``_merged`` made. A layer with
    another format is prepared in memory as before."""
    source = tmp_path / "model.gguf"
    source.write_bytes(b"a GGUF file's stand-in: the cache keys on its path, size and time")
    formats = [(0, "Q4_K", 32), (32, "Q4_K", 16), (48, "Q6_K", 16)]
    pieces = {
        first: QuantizedTensor(random_tensor(fmt, rows, 512, first).data, fmt, (rows, 512), fmt)
        for first, fmt, rows in formats
    }
    want = gguf_linear_method._merged({f: unpacked(p) for f, p in pieces.items()})

    def no_copy(*args):
        raise AssertionError("the layer was prepared in memory and written")

    monkeypatch.setattr(PreparedWeights, "_save", no_copy)
    monkeypatch.setattr(gguf_linear_method, "_unpacked_runs", no_copy)
    got = gguf_linear_method._unpacked_in_place(PreparedWeights(source), "qkv", pieces)
    assert got is not None
    assert_same_parts(got, want)
    (entry,) = cache_root.glob("*/*.bin")
    assert not list(cache_root.glob("*/*.tmp"))
    tensors = [t for _, part in got for t in prepared_weights._fields(part)]
    assert all(t.untyped_storage().nbytes() == entry.stat().st_size for t in tensors)
    again = PreparedWeights(source).load("qkv")
    assert again is not None
    assert_same_parts(again, want)
    # 32-value blocks too, beside K-quant ones (Q4_K_M's layers, a Q4_0 file's)
    pieces[64] = QuantizedTensor(random_tensor("Q8_0", 16).data, "Q8_0", (16, 512), "Q8_0")
    for first, fmt in [(80, "Q4_0"), (96, "Q4_0"), (112, "Q4_1")]:
        pieces[first] = QuantizedTensor(
            random_tensor(fmt, 16, 512, first).data, fmt, (16, 512), fmt
        )
    want = gguf_linear_method._merged({f: unpacked(p) for f, p in pieces.items()})
    got = gguf_linear_method._unpacked_in_place(PreparedWeights(source), "all", pieces)
    assert got is not None and [f for f, _ in got] == [0, 48, 64, 80, 112]
    assert_same_parts(got, want)
    # a Q4_0 offset float16 cannot hold: prepared in memory (float32 scales), nothing left
    big = random_tensor("Q4_0", 16, 512, 7).data
    big[3, 0:2] = torch.tensor([20000.0], dtype=torch.float16).view(torch.uint8)
    pieces[80] = QuantizedTensor(big, "Q4_0", (16, 512), "big")
    assert gguf_linear_method._unpacked_in_place(PreparedWeights(source), "big", pieces) is None
    assert not list(cache_root.glob("*/*.tmp"))


@needs_kernels
def test_a_file_system_without_fallocate_writes_entries_from_memory(
    tmp_path, cache_root, monkeypatch
):
    """Where the entry's space cannot be reserved (no ``posix_fallocate``), the layer is
    prepared in memory and written as before: the cache stays in use."""
    import errno

    source = tmp_path / "model.gguf"
    source.write_bytes(b"a GGUF file's stand-in: the cache keys on its path, size and time")

    def unsupported(*args):
        raise OSError(errno.EOPNOTSUPP, "not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    piece = QuantizedTensor(random_tensor("Q6_K", 16).data, "Q6_K", (16, 512), "v")
    prepared = PreparedWeights(source)
    assert gguf_linear_method._unpacked_in_place(prepared, "v", {0: piece}) is None
    monkeypatch.delattr(os, "posix_fallocate")  # an OS without it (macOS)
    assert gguf_linear_method._unpacked_in_place(prepared, "v", {0: piece}) is None
    assert not list(cache_root.glob("*/*.tmp"))
    prepared.save("v", [(0, unpacked(piece))])
    assert prepared.load("v") is not None


@needs_kernels
def test_a_dead_writers_temporary_entry_is_removed(tmp_path, cache_root):
    """A process killed while filling an entry leaves its temporary file (reserved at the
    layer's full size): the next write in that directory removes it, and leaves a live
    process's."""
    import subprocess
    import sys

    source = tmp_path / "model.gguf"
    source.write_bytes(b"a GGUF file's stand-in: the cache keys on its path, size and time")
    prepared = PreparedWeights(source)
    piece = QuantizedTensor(random_tensor("Q4_K", 16).data, "Q4_K", (16, 512), "k")
    assert gguf_linear_method._unpacked_in_place(prepared, "k", {0: piece}) is not None
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    stale = prepared.directory / f"{dead.stdout.strip()}-left.tmp"
    live = prepared.directory / f"{os.getppid()}-writing.tmp"
    stale.write_bytes(b"\0" * 4096)
    live.write_bytes(b"\0" * 4096)
    assert gguf_linear_method._unpacked_in_place(prepared, "k2", {0: piece}) is not None
    assert not stale.exists() and live.exists()


def _mapped_bytes(mapped: torch.Tensor, field: str = "FilePmdMapped") -> int:
    """A ``/proc/self/smaps`` field of the mapping under ``mapped``, in bytes: by default
    what this process maps of it with 2 MiB page-table entries."""
    return int(mappings_under(mapped).get(field, 0))


def _touched(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        t.view(torch.uint8).sum()


def _files_map_in_huge_pages(directory: Any) -> bool:
    """Whether this kernel and file system map a file in huge pages at all: one written
    with ``write`` (huge page-cache folios where the file system has them), mapped and
    advised by the test itself."""
    probe = directory / "probe"
    probe.write_bytes(b"\1" * (4 * HUGE_PAGE))
    mapped = torch.from_file(str(probe), shared=False, size=4 * HUGE_PAGE, dtype=torch.uint8)
    _touched([mapped])
    found = _mapped_bytes(mapped) > 0
    del mapped
    probe.unlink()
    return found


@needs_kernels
def test_prepared_weights_are_mapped_in_huge_pages(tmp_path, cache_root):
    """A decode step streams through every weight; in 4 KiB pages each costs a TLB miss and
    ends the prefetcher's stream. An entry a first load fills in place, the same entry
    mapped by a warm load, and the entry read again from disk once the page cache let it
    go are all mapped in 2 MiB pages (all but the entry's unaligned ends)."""
    if not _files_map_in_huge_pages(tmp_path):
        pytest.skip("this kernel or file system maps no file in huge pages (THP off?)")
    source = tmp_path / "model.gguf"
    source.write_bytes(b"a GGUF file's stand-in: the cache keys on its path, size and time")
    piece = QuantizedTensor(random_tensor("Q4_0", 4096, 4096).data, "Q4_0", (4096, 4096), "w")

    def huge_share(parts: Any) -> float:
        (entry,) = cache_root.glob("*/*.bin")
        tensors = [t for _, part in parts for t in prepared_weights._fields(part)]
        _touched(tensors)
        whole = entry.stat().st_size // HUGE_PAGE * HUGE_PAGE - HUGE_PAGE  # the ends
        return _mapped_bytes(tensors[0]) / whole

    first = gguf_linear_method._unpacked_in_place(PreparedWeights(source), "w", {0: piece})
    assert first is not None and huge_share(first) >= 1.0
    del first
    warm = PreparedWeights(source).load("w")
    assert warm is not None and huge_share(warm) >= 1.0
    del warm
    (entry,) = cache_root.glob("*/*.bin")
    _evicted(entry)
    cold = PreparedWeights(source).load("w")
    assert cold is not None and huge_share(cold) >= 1.0


def _evicted(path: Any) -> None:
    """``path``'s pages dropped from the page cache: the next read comes from disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # written back first: dirty pages stay
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@needs_kernels
def test_a_token_embeddings_table_stays_resident_only_where_rows_are_looked_up(
    tmp_path, cache_root
):
    """A token embedding's float table is read a row at a time, at random, and a mapping
    maps a page-cache folio whole: the first load fills it in small folios and no load
    reads ahead, so 32 rows looked up make about 32 rows resident (with the kernel's
    64 KiB fault-around once the page cache holds the table), not 32 huge folios."""
    source = tmp_path / "model.gguf"
    source.write_bytes(b"a GGUF file's stand-in: the cache keys on its path, size and time")
    blocks = QuantizedTensor(random_tensor("Q8_0", 8192, 1024).data, "Q8_0", (8192, 1024), "e")
    rng = np.random.default_rng(0)

    def resident_after_lookups(table: torch.Tensor) -> int:
        for row in rng.integers(0, table.shape[0], 32):
            table[int(row)].sum()
        return _mapped_bytes(table, "Rss")

    table = gguf_linear_method._table_in_place(PreparedWeights(source), "embedding", blocks)
    assert table is not None
    row = table.shape[1] * table.element_size()
    assert resident_after_lookups(table) <= 32 * (row + (64 << 10))
    del table
    (entry,) = cache_root.glob("*/*.bin")
    _evicted(entry)
    cold = PreparedWeights(source).load_table("embedding")
    assert cold is not None
    assert resident_after_lookups(cold) <= 32 * (row + 2 * 4096)


def test_an_entry_that_cannot_be_mapped_is_a_miss(tmp_path, cache_root, caplog):
    """Something at an entry's path that cannot be mapped (here a directory) is a miss
    with a warning, as an entry that does not parse is: the layer is prepared again."""
    source = tmp_path / "model.gguf"
    source.write_bytes(b"a GGUF file's stand-in: the cache keys on its path, size and time")
    prepared = PreparedWeights(source)
    prepared.save("layer", [(0, unpacked(random_tensor("Q4_0")))])
    (entry,) = cache_root.glob("*/*.bin")
    entry.unlink()
    entry.mkdir()
    assert PreparedWeights(source).load("layer") is None
    assert "unreadable" in caplog.text
