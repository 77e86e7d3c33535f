"""llama.cpp's side of ``single_stream.py``, run by the llama-cpp-python venv's Python:
prints one JSON line (prefill seconds, decode tokens/s, total tokens/s at each
concurrency, run one request after another: llama-cpp-python serves one sequence).
Decode tokens/s is ``decode_len - 1`` over the time from the first yielded token to the
last, within one request, as ``single_stream.py`` times ours.

A sixth argument ``no-repack`` loads the weights without llama.cpp's extra buffer types
(its repacked and AMX layouts), for builds whose repacking crashes on this CPU."""

from __future__ import annotations

import json
import sys
import time

from llama_cpp import Llama
from llamacpp_repack import without_repacking


def main() -> None:
    path, threads, prompt_len, decode_len = sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:5])
    concurrency = [int(c) for c in sys.argv[5].split(",")]
    if sys.argv[6:] == ["no-repack"]:
        without_repacking()
    llm = Llama(path, n_threads=threads, n_ctx=1024, verbose=False, seed=0)
    prompt = [(17 * i) % 20000 + 100 for i in range(prompt_len)]

    def run(max_tokens: int) -> tuple[float, list[float]]:
        """Seconds the request took, and when (perf_counter) each token came."""
        llm.reset()
        started = time.perf_counter()
        arrivals = []
        for n, _ in enumerate(llm.generate(prompt, temp=0.0, top_k=1)):
            arrivals.append(time.perf_counter())
            if n + 1 >= max_tokens:
                break
        return time.perf_counter() - started, arrivals

    run(4)  # warm-up
    prefill, _ = run(1)
    _, arrivals = run(decode_len)
    assert len(arrivals) == decode_len
    result = {"prefill_s": prefill, "decode_tok_s": (decode_len - 1) / (arrivals[-1] - arrivals[0])}
    for c in concurrency:
        started = time.perf_counter()
        for _ in range(c):
            run(32)
        result[f"throughput_{c}"] = 32 * c / (time.perf_counter() - started)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
