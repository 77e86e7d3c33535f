"""Embeddings throughput (inputs per second) of ``LLM.embed`` against
sentence-transformers' ``encode`` on the same random-weight checkpoint, at batch sizes
1, 32 and 256, the two run alternately in the same process.

    python benchmarks/embeddings.py --arch bert --size small --rounds 3

Each round embeds ``--num-inputs`` texts (about ``--words`` words each) in batches of
the given size with each system; the figure is the median over rounds. The engine runs
in its own process (as served); sentence-transformers runs in this one, on the same
threads budget (``--threads``). Vectors are checked equal first.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import sys
import tempfile
import time

import numpy as np
from random_words import WORDS


def _texts(num: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(words // 2, words)))
        for _ in range(num)
    ]


def _timed(fn, texts: list[str], batch: int) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    for i in range(0, len(texts), batch):
        fn(texts[i : i + batch])
    return len(texts) / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a sentence-transformers checkpoint")
    parser.add_argument("--arch", default="bert", choices=["bert", "qwen3", "llama"])
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--batches", default="1,32,256")
    parser.add_argument("--num-inputs", type=int, default=256)
    parser.add_argument("--words", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads, both sides")
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    from enginecore import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        from enginecore.embedding_checkpoints import make_embedding_checkpoint

        work = pathlib.Path(tempfile.mkdtemp(prefix="bench-embeddings-"))
        pooling = "mean" if args.arch == "bert" else "last"
        model = str(make_embedding_checkpoint(work / "model", args.arch, pooling, size=args.size))
    batches = [int(b) for b in args.batches.split(",")]
    texts = _texts(args.num_inputs, args.words, seed=0)
    st = SentenceTransformer(model, device="cpu")
    llm = LLM(model, runner="pooling", max_num_seqs=max(batches), max_num_batched_tokens=16384)
    try:
        ours = np.array([o.outputs.embedding for o in llm.embed(texts[:8], use_tqdm=False)])
        np.testing.assert_allclose(ours, st.encode(texts[:8]), atol=1e-4, rtol=1e-3)

        def engine(batch: list[str]) -> None:
            llm.embed(batch, use_tqdm=False)

        def reference(batch: list[str]) -> None:
            st.encode(batch, batch_size=len(batch))

        results: dict[str, dict[str, list[float]]] = {}
        for batch in batches:
            rows = results[str(batch)] = {"enginecore": [], "sentence_transformers": []}
            for _ in range(args.rounds):
                rows["enginecore"].append(_timed(engine, texts, batch))
                rows["sentence_transformers"].append(_timed(reference, texts, batch))
            ours_ips = statistics.median(rows["enginecore"])
            ref_ips = statistics.median(rows["sentence_transformers"])
            print(
                f"batch {batch}: enginecore {ours_ips:.1f} inputs/s, sentence-transformers "
                f"{ref_ips:.1f} inputs/s, ratio {ours_ips / ref_ips:.2f}x",
                flush=True,
            )
    finally:
        llm.shutdown()
    print(f"load average {os.getloadavg()}")
    if args.result_file:
        pathlib.Path(args.result_file).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
