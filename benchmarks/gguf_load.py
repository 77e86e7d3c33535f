"""A GGUF file's load on CPU: seconds to a ready engine, the first request's time to its
first token, and resident memory, with the prepared-weight cache cold and warm.

Each run is a fresh process (``LLM(..., multiprocessing=False)``, so one process holds
the engine and its memory is the engine's). ``first``: this file's prepared weights
removed from the cache beforehand (with ``--new-cache`` the whole cache, so that the C
kernels are compiled too); ``warm``: prepared already. The first request is a
128-token prompt and one output token, sent right after the engine is ready; a second
and a third follow, each with other tokens (the same prompt again would be served from the
prefix cache).
The page faults to a ready engine (minor: memory first touched, a page of a new file
written through a mapping) count work that the machine's other load does not inflate.
Resident memory (RSS, and PSS: the mapped files' pages shared with other processes counted
in part) is taken when the engine is ready and after the three requests, and the
process's CPU time (user and system, all threads) when it is ready: on a shared machine
the wall times grow with the other load, the CPU time much less. With
``--baseline-src DIR`` (a source tree of another commit, for example
``git archive main | tar -x -C DIR``) each run is repeated on that tree, alternately, so
both see the same machine load. Each tree keeps its kernels and prepared weights in a
cache of its own (``TREE/.enginecore-cache``), so that neither run finds what another
checkout, or the other tree, prepared.

With ``--new-step-library`` the first run finds only the fused decode step's library
missing, so its requests are served while that library compiles (and nothing else does).
With ``--new-kernels`` it finds no compiled library or object at all but its prepared
weights kept (made by a run just before it): the start after an upgrade of the package
or on a new CPU, every library compiling.

With ``--llama-python PY`` (a Python with llama-cpp-python) llama.cpp loads the file
after each warm run, in a fresh process, with the same requests.

    python benchmarks/gguf_load.py FILE.gguf [--rounds 2] [--baseline-src DIR] [--new-cache]
        [--llama-python PY]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys

# Each side's script: its imports, its engine's start, ``timed(start)`` for one
# 128-token request, then the shared measurements around them.
_READY = """
ready = time.perf_counter()
ready_memory = psutil.Process().memory_full_info()
usage = resource.getrusage(resource.RUSAGE_SELF)
cpu_ready = usage.ru_utime + usage.ru_stime
faults_ready = usage.ru_minflt
"""
_REPORT = """
ttft, token = timed(300)
second, _ = timed(1300)
third, _ = timed(2300)
memory = psutil.Process().memory_full_info()
print(json.dumps({"import_s": imported - started, "ready_s": ready - imported,
    "cpu_to_ready_s": cpu_ready, "page_faults_to_ready": faults_ready,
    "first_request_s": ttft, "second_request_s": second, "third_request_s": third,
    "rss_ready_gib": ready_memory.rss / 2**30, "rss_gib": memory.rss / 2**30,
    "pss_ready_gib": ready_memory.pss / 2**30, "pss_gib": memory.pss / 2**30, "token": token}))
"""

RUN = (
    """
import json, resource, sys, time
started = time.perf_counter()
import psutil
from enginecore import LLM, SamplingParams
imported = time.perf_counter()
llm = LLM(model=sys.argv[1], max_model_len=512, multiprocessing=False)
"""
    + _READY
    + """
params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
def timed(start):
    prompt = {"prompt_token_ids": list(range(start, start + 128))}
    t = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)
    return time.perf_counter() - t, out[0].outputs[0].token_ids
"""
    + _REPORT
    + "llm.shutdown()\n"
)

# llama.cpp's side (``--llama-python``): the same process shape, requests and figures
# (llama-cpp-python serves one sequence: each request resets its context).
LLAMA_RUN = (
    """
import json, resource, sys, time
started = time.perf_counter()
import psutil
from llama_cpp import Llama
imported = time.perf_counter()
llm = Llama(sys.argv[1], n_ctx=512, verbose=False, seed=0)
"""
    + _READY
    + """
def timed(start):
    llm.reset()
    t = time.perf_counter()
    token = next(iter(llm.generate(list(range(start, start + 128)), temp=0.0, top_k=1)))
    return time.perf_counter() - t, [token]
"""
    + _REPORT
)


def source_path(tree: pathlib.Path) -> str:
    """PYTHONPATH entries that put ``tree``'s packages before the installed ones."""
    roots = [tree / "core", *sorted(p for p in tree.glob("builtin_*") if p.is_dir())]
    return os.pathsep.join(str(p) for p in roots)


THIS_TREE = pathlib.Path(__file__).resolve().parents[1]


def tree_cache(tree: pathlib.Path) -> pathlib.Path:
    """A tree's own cache (kernels, prepared weights): two trees sharing one would
    replace each other's prepared weights of the same file at every run."""
    return tree / ".enginecore-cache"


def remove_step_library(kernels: pathlib.Path) -> None:
    """The fused decode step's library and every compiled object gone from a kernel
    cache (the step's library links objects of the other sources, compiled its own way)."""
    for library in kernels.glob("enginecore_decode_step_*.so"):
        library.unlink()
    shutil.rmtree(kernels / "objects", True)


def run_llamacpp(model: str, python: str) -> dict[str, object]:
    out = subprocess.run(
        [python, "-c", LLAMA_RUN, model], capture_output=True, text=True, check=False
    )
    if out.returncode:
        raise SystemExit(f"llama.cpp's run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(model: str, tree: pathlib.Path | None) -> dict[str, object]:
    env = dict(os.environ, ENGINECORE_STARTUP_LOG="0")
    env["ENGINECORE_CACHE_DIR"] = str(tree_cache(tree or THIS_TREE))
    if tree is not None:
        env["PYTHONPATH"] = source_path(tree)
    out = subprocess.run(
        [sys.executable, "-c", RUN, model], env=env, capture_output=True, text=True, check=False
    )
    if out.returncode:
        raise SystemExit(f"the run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=2, help="warm runs of each tree")
    parser.add_argument("--baseline-src", type=pathlib.Path)
    parser.add_argument(
        "--new-cache",
        action="store_true",
        help="the first run starts from an empty cache (the C kernels compiled too)",
    )
    parser.add_argument(
        "--new-step-library",
        action="store_true",
        help="the first run finds every library built but the fused decode step's (and no "
        "compiled objects) and its prepared weights kept: the requests served while that "
        "library compiles in the background, alone",
    )
    parser.add_argument(
        "--new-kernels",
        action="store_true",
        help="the first run finds the kernel cache empty (no library, no object) and its "
        "prepared weights kept: every library compiles while the requests are served",
    )
    parser.add_argument(
        "--warm-only", action="store_true", help="no first run: each tree's cache as it is"
    )
    parser.add_argument(
        "--llama-python",
        help="a Python with llama-cpp-python: llama.cpp loads the file after each warm "
        "run too (it keeps no cache: its every load is the same)",
    )
    args = parser.parse_args()
    model = str(pathlib.Path(args.model).resolve())
    trees: list[tuple[str, pathlib.Path | None]] = [("this tree", None)]
    if args.baseline_src:
        trees.insert(0, ("baseline", args.baseline_src.resolve()))
    print(f"load average {os.getloadavg()}")
    for label in ["first"] * (not args.warm_only) + ["warm"] * args.rounds:
        for name, tree in trees:
            if label == "first":
                cache = tree_cache(tree or THIS_TREE)
                if args.new_kernels:
                    run(model, tree)  # this file's prepared weights, kept for the first run
                    shutil.rmtree(cache / "cpu_kernels", True)
                elif args.new_step_library:
                    remove_step_library(cache / "cpu_kernels")
                else:
                    shutil.rmtree(cache if args.new_cache else cache / "prepared_weights", True)
            print(json.dumps({"tree": name, "run": label, **run(model, tree)}), flush=True)
        if args.llama_python and label == "warm":
            result = run_llamacpp(model, args.llama_python)
            print(json.dumps({"tree": "llama.cpp", "run": label, **result}), flush=True)
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
