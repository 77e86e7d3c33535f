"""Host memory of a CPU runner (builtin_cpu/enginecore_cpu/host_memory.py): the malloc setting that
keeps a step's freed activations mapped, and the start of the KV cache and of the decode
mirror allocated; the KV cache's first blocks faulted in once the runner starts rather
than in the first batch's steps, on a thread of their own: the start does not wait for
them; what is faulted in is what one sequence of the longest length fills, not memory a
single stream never uses; what the load freed handed back to the OS."""

from __future__ import annotations

import ctypes
import mmap
import resource
import subprocess
import sys
import textwrap

import pytest
import torch

from enginecore import make_config
from enginecore.interfaces import WorkerSpec
from enginecore_cpu.attention import prefault_blocks
from enginecore_cpu.host_memory import PREFAULT_BYTES, keep_freed_memory
from enginecore_models.model_runner import TorchModelRunner


def _faults_while(fn) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


STARTING_FAULTS = {}  # the minor faults of the thread that sized the KV cache, during it


def _resident_bytes(span: torch.Tensor) -> int:
    """Bytes of a contiguous tensor's pages that are in memory (mincore(2)): read without
    touching them, so the count is the same on a loaded machine."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = mmap.PAGESIZE
    start = span.data_ptr() // page * page
    pages = -(-(span.data_ptr() + span.numel() * span.element_size() - start) // page)
    vector = ctypes.create_string_buffer(pages)
    assert libc.mincore(start, pages * page, vector) == 0, ctypes.get_errno()
    return sum(byte & 1 for byte in vector.raw) * page


def _loaded_runner(checkpoint, model_refs, max_model_len: int = 512) -> TorchModelRunner:
    spec = WorkerSpec(
        worker_ref="enginecore_executors.worker:Worker",
        model_runner_ref="enginecore_models.model_runner:TorchModelRunner",
        model_refs=model_refs,
    )
    config = make_config(model=str(checkpoint), dtype="float32", max_model_len=max_model_len)
    runner = TorchModelRunner(config, spec, torch.device("cpu"))
    runner.load_model()
    return runner


@pytest.fixture(scope="module")
def runner(tiny_llama, model_refs):
    # The longest sequence's blocks (64 MiB) are the start faulted in.
    runner = _loaded_runner(tiny_llama, model_refs, max_model_len=4096)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    # 9 GB (mapped, not resident): room for the decode mirror's every row at full length
    runner.initialize_kv_cache(140_000)
    STARTING_FAULTS["kv"] = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    prefaulted = getattr(runner.attn_backend, "prefaulted", None)
    assert prefaulted is None or prefaulted.wait(timeout=120)
    return runner


def _first_blocks(runner) -> int:
    """The null block and one longest sequence's blocks: those the start faults in."""
    return 1 + -(-runner.get_max_model_len() // runner.block_size)


def test_the_start_does_not_wait_for_the_prefault(runner):
    """The pages faulted in ahead of the steps (the KV cache's first blocks) are faulted
    in off the thread that starts the engine: its start took a fraction of their faults
    (it used to take them all, most of a demo model's load). It takes some of its own:
    the heap's pages that the trim after the allocation gave back, as the fused step
    allocates again."""
    pages = _first_blocks(runner) * runner.get_kv_cache_block_bytes() // 4096
    assert STARTING_FAULTS["kv"] < pages // 4, STARTING_FAULTS


def test_the_kv_cache_resident_at_start_up_is_one_longest_sequence(runner):
    """No more of the KV cache is in memory after the start than one sequence of the
    longest length fills (it used to be 256 MiB whatever the model's length, resident
    from the start in a single stream that never wrote it)."""
    first = _first_blocks(runner)
    assert prefault_blocks(runner.attn_backend.spec, runner.num_blocks) == first
    assert first * runner.get_kv_cache_block_bytes() < PREFAULT_BYTES
    per_layer = first * runner.get_kv_cache_block_bytes() // len(runner.kv_caches)
    for cache in runner.kv_caches:
        assert sum(_resident_bytes(cache[kv, :first]) for kv in (0, 1)) >= per_layer
        assert sum(_resident_bytes(cache[kv, first:]) for kv in (0, 1)) == 0


def test_the_first_kv_blocks_are_faulted_in_at_start_up(runner):
    first = _first_blocks(runner)
    assert 0 < first < runner.num_blocks
    cache = runner.kv_caches[0]
    pages = cache[0, 1:first].numel() * 4 // 4096
    assert _faults_while(lambda: cache[0, 1:first].fill_(1.0)) < pages // 100
    # The blocks after them are still mapped on first touch.
    later = cache[0, first : 2 * first]
    assert _faults_while(lambda: later.fill_(1.0)) > pages // 2


def test_the_decode_mirror_is_allocated_for_every_row_and_not_faulted_in(runner):
    """Every row is allocated before any step (the mirror never regrows), and none of it
    is in memory: a row's pages come in with its request's context. The first positions
    of every row used to be faulted in, none of which a single stream decodes in but
    row 0's, and that one's first positions only."""
    mirror = runner.attn_backend.mirror
    rows = runner.config.scheduler.max_num_seqs
    assert mirror.layers and mirror.layers[0].shape[1] >= rows  # every row, before any step
    assert sum(_resident_bytes(layer) for layer in mirror.layers) == 0


MALLOC_STATE = """
    import ctypes, sys, torch
    from enginecore_cpu.host_memory import keep_freed_memory

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    info = ctypes.CDLL(None).mallinfo2
    info.restype = MallInfo2
    if sys.argv[1] == "keep":
        assert keep_freed_memory()
    x = torch.empty(5 << 20)  # 20 MiB, as a prefill step's activations
    mapped = info().hblkhd  # bytes in blocks that have a mapping of their own
    del x
    print(mapped, info().arena)  # and the heap left after freeing it
"""


def test_keep_freed_memory_serves_activations_from_a_heap_it_keeps():
    # glibc's default serves a block this large with its own mmap and unmaps it on free,
    # so the next one is faulted in page by page again.
    if not keep_freed_memory():
        pytest.skip("not glibc: mallopt is not available")
    mib = 1 << 20
    state = {}
    for mode in ("default", "keep"):
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(MALLOC_STATE), mode],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        state[mode] = [int(v) for v in done.stdout.split()]
    default_mapped, _ = state["default"]
    kept_mapped, kept_heap = state["keep"]
    assert default_mapped >= 20 * mib
    assert kept_mapped < 20 * mib  # from the heap ...
    assert kept_heap >= 20 * mib  # ... which keeps the freed block


LOAD_THEN_TRIM = """
    import ctypes, mmap, sys, torch
    from enginecore import make_config
    from enginecore.interfaces import WorkerSpec
    from enginecore.plugins import make_plugin_manager
    from enginecore_models.model_runner import TorchModelRunner

    def resident():
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * mmap.PAGESIZE

    registry = make_plugin_manager(load_entrypoints=False).registry("model")
    spec = WorkerSpec(
        worker_ref="enginecore_executors.worker:Worker",
        model_runner_ref="enginecore_models.model_runner:TorchModelRunner",
        model_refs={name: registry.entry(name).ref for name in registry.names()},
    )
    config = make_config(model=sys.argv[1], max_model_len=512)
    runner = TorchModelRunner(config, spec, torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(1000)
    assert runner.attn_backend.prefaulted.wait(timeout=120)
    before = resident()
    ctypes.CDLL(None).malloc_trim(0)
    print(before - resident())
"""


def test_what_the_load_freed_is_not_kept_resident(tiny_llama):
    """A runner ready to serve holds no freed memory that a trim would give back: the
    load's garbage (14 MiB for the tiny checkpoint, 42 MiB for the demo GGUF, 33 MiB for
    a 1.7B one) was kept for the process's life, since the steps' malloc keeps what is
    freed."""
    if not keep_freed_memory():
        pytest.skip("not glibc: no malloc_trim")
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(LOAD_THEN_TRIM), str(tiny_llama)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    released = int(done.stdout.split()[-1])
    assert released < 4 << 20, released


def test_sleep_right_after_the_start_frees_the_kv_cache(tiny_llama, model_refs):
    """Sleep while the first pages are still being faulted in: the prefault stops and
    lets go of the cache, so sleep frees it (the thread held it, and went on faulting in
    pages, until it was done)."""
    import gc
    import weakref

    runner = _loaded_runner(tiny_llama, model_refs)
    runner.initialize_kv_cache(40_000)
    prefaulted = runner.attn_backend.prefaulted
    caches = [weakref.ref(cache) for cache in runner.kv_caches]
    runner.sleep(1)
    gc.collect()
    assert prefaulted is None or prefaulted.is_set()
    assert all(cache() is None for cache in caches)
