"""Detokenization per token: the piece table against ``DecodeStream`` alone.

N requests each receive one token per step, the tokens of English and multilingual text,
as the output processor feeds a streaming request (``IncrementalDetokenizer.
add_token_to_text``: decoded as it comes); the same detokenizer runs with its piece table
and with the table emptied (every token through ``tokenizers``' ``DecodeStream``, the path
before the table), alternately, ``--rounds`` times. Prints microseconds of CPU per token
and the ratio of the medians; then the same tokens queued as for a request whose text is
read only when it finishes (``add_token``, folded when ``text`` is read at the end).

    python benchmarks/detokenize.py [--requests 256] [--steps 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from enginecore.checkpoints import make_demo_checkpoint, make_tokenizer
from enginecore.engine.detokenizer import IncrementalDetokenizer
from enginecore.params import SamplingParams

TEXT = (
    "The engine schedules each step, runs the model and samples one token per request; "
    "the frontend turns the tokens into text as they arrive. Grüße, naïve café, 日本語, "
    "emoji 🙂🚀 and code: def f(x): return {'y': [x, 2]}\n"
)


def per_token_us(
    tokenizer: Any, ids: list[int], requests: int, steps: int, table: bool, queued: bool = False
) -> float:
    dets = [IncrementalDetokenizer(tokenizer, SamplingParams()) for _ in range(requests)]
    for i, det in enumerate(dets):
        if not table:
            det._pieces = {}
        det.update([ids[i % len(ids)]])
    c0 = time.process_time()
    for step in range(1, steps + 1):
        for i, det in enumerate(dets):
            token_id = ids[(i * 7 + step) % len(ids)]
            if queued:
                det.add_token(token_id)
            else:
                det.add_token_to_text(token_id)
    texts = [det.text for det in dets]  # folds the queued tokens
    assert all(texts)
    return (time.process_time() - c0) / (requests * steps) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizers = {
        "byte-level BPE (tests, 8192)": make_tokenizer(8192),
        "demo model (SmolLM2)": AutoTokenizer.from_pretrained(make_demo_checkpoint()),
    }
    for name, tokenizer in tokenizers.items():
        ids = tokenizer.encode(TEXT * 20, add_special_tokens=False)
        runs: dict[bool, list[float]] = {True: [], False: []}
        folded: list[float] = []
        for _ in range(args.rounds):
            for table in (False, True):
                runs[table].append(per_token_us(tokenizer, ids, args.requests, args.steps, table))
            folded.append(per_token_us(tokenizer, ids, args.requests, args.steps, True, True))
        stream, looked_up = statistics.median(runs[False]), statistics.median(runs[True])
        print(
            f"{name}: DecodeStream {stream:.2f} us/token, piece table {looked_up:.2f} us/token, "
            f"{stream / looked_up:.2f}x; queued and folded at the end "
            f"{statistics.median(folded):.2f} us/token"
        )


if __name__ == "__main__":
    main()
