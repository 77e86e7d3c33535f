"""Where a CPU engine's resident memory is, by mapping: the prepared-weight entries, the
KV cache and the decode mirror (their pages in memory, by ``mincore``), the main heap,
the shared libraries and the rest of the anonymous memory; when the engine is ready and
after three 128-token requests, each with other tokens (as ``gguf_load.py`` sends them),
then 32 decode steps. One process (``multiprocessing=False``), so the memory is the
engine's. Resident bytes do not depend on the machine's load.

    python benchmarks/resident_by_mapping.py FILE.gguf [--max-model-len 512]

For another tree's figures, run it with that tree's packages first on ``PYTHONPATH``
(``gguf_load.source_path``) and its own ``ENGINECORE_CACHE_DIR``.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import mmap
import re
from typing import Any

import torch

from enginecore import LLM, SamplingParams

MIB = 1 << 20


def resident_bytes(tensors: list[torch.Tensor]) -> int:
    """The bytes of the tensors' pages that are in memory, read without touching them."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page, total = mmap.PAGESIZE, 0
    for tensor in tensors:
        start = tensor.data_ptr() // page * page
        end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
        pages = -(-(end - start) // page)
        vector = ctypes.create_string_buffer(pages)
        if libc.mincore(start, pages * page, vector):
            raise OSError(ctypes.get_errno(), "mincore")
        total += sum(byte & 1 for byte in vector.raw) * page
    return total


def by_mapping() -> dict[str, int]:
    """Resident bytes of ``/proc/self/smaps`` by kind of mapping."""
    groups: dict[str, int] = collections.defaultdict(int)
    name = ""
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                path = fields[5] if len(fields) > 5 else "[anon]"
                if "prepared_weights" in path:
                    name = "prepared entries"
                elif path.endswith(".gguf"):
                    name = "the GGUF file"
                elif path.startswith("/"):
                    name = "shared libraries and other files"
                else:
                    name = path
            elif fields[0] == "Rss:":
                groups[name] += int(fields[1]) * 1024
    return groups


def report(label: str, runner: Any) -> None:
    groups = by_mapping()
    kv = resident_bytes(runner.kv_caches)
    mirror = runner.attn_backend.mirror
    mirrored = resident_bytes(mirror.layers) if mirror is not None else 0
    print(f"{label}: {sum(groups.values()) / MIB:.1f} MiB resident")
    print(f"  KV cache {kv / MIB:.1f} MiB, decode mirror {mirrored / MIB:.1f} MiB (anonymous)")
    anonymous = groups.pop("[anon]", 0) - kv - mirrored
    groups["other anonymous memory"] = anonymous
    for name, size in sorted(groups.items(), key=lambda item: -item[1]):
        if size >= MIB:
            print(f"  {name} {size / MIB:.1f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--max-model-len", type=int, default=512)
    args = parser.parse_args()
    llm = LLM(model=args.model, max_model_len=args.max_model_len, multiprocessing=False)
    runner = llm.collective_rpc(lambda worker: worker)[0].model_runner
    prefaulted = runner.attn_backend.prefaulted
    if prefaulted is not None:
        prefaulted.wait()
    report("ready", runner)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for start in (300, 1300, 2300):
        prompt = {"prompt_token_ids": list(range(start, start + 128))}
        llm.generate([prompt], params, use_tqdm=False)
    report("after three requests", runner)
    decode = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(5, 20))}], decode, use_tqdm=False)
    report("after 32 decode steps", runner)
    llm.shutdown()


if __name__ == "__main__":
    main()
