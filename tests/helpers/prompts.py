"""Token-id prompts of many lengths, every third sharing a prefix: the mixed batch the correctness tests run."""

from __future__ import annotations

import random

PROMPT_LENGTHS = [3, 7, 12, 17, 25, 31, 40, 48, 55, 64, 70, 81, 90, 100, 5, 33]


SHARED_PREFIX = 40  # tokens shared by every third prompt: two full blocks and a bit


def mixed_prompts(seed: int = 0, vocab: int = 8192) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(10, vocab) for _ in range(SHARED_PREFIX)]
    prompts = []
    for i, n in enumerate(PROMPT_LENGTHS):
        body = [rng.randrange(10, vocab) for _ in range(n)]
        prompts.append(prefix + body if i % 3 == 0 else body)
    return prompts
