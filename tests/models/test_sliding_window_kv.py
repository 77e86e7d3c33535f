"""Sliding-window layers keep only their window in the KV cache, through the whole engine.

Prompts and outputs run far past the window, with chunked prefill, prefix caching and a
mixed batch; every step the scheduler's KV cache groups are checked (a sliding group
holds only its window's blocks, a full group every block) and the greedy tokens must be
transformers'. Mistral has one sliding group; Qwen2 (with ``max_window_layers``), Gemma 2
and Gemma 3 pair full-attention and sliding groups whose layers share cache tensors.
"""

from __future__ import annotations

import random

import pytest

from enginecore import LLM, SamplingParams
from tests.helpers.hf_reference import assert_matches_reference, greedy_reference

# Each test runs the engine and transformers' generate over long prompts: 20-120 s.
pytestmark = pytest.mark.slow

CHUNK = 20  # max_num_batched_tokens: prompts split across steps, decodes mix with chunks
MAX_TOKENS = 24


def _prompts(seed: int, lengths: list[int], shared: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(10, 8000) for _ in range(shared)]
    return [
        (prefix if i % 2 == 0 else []) + [rng.randrange(10, 8000) for _ in range(n)]
        for i, n in enumerate(lengths)
    ]


class _GroupWatch:
    """Wraps the engine's ``schedule`` to check each running request's blocks per group
    after every step's allocation, and to count preemptions."""

    def __init__(self, llm: LLM) -> None:
        engine = llm.engine_client.engine
        self.scheduler = engine.scheduler
        self.kv = self.scheduler.kv_cache_manager
        self.windows = self.kv.group_windows
        self.block_size = self.kv.block_size
        self.steps = 0
        self.preemptions = 0
        self.draft_steps = 0
        self.max_sliding_held = 0
        schedule = self.scheduler.schedule

        def watched_schedule():
            out = schedule()
            self._check(out)
            return out

        self.scheduler.schedule = watched_schedule

    def _check(self, out) -> None:
        self.steps += 1
        self.preemptions += len(out.preempted_req_ids)
        self.draft_steps += bool(out.scheduled_spec_decode_tokens)
        bs = self.block_size
        for request in self.scheduler.running:
            held = self.kv.num_held_blocks(request.request_id)
            computed = request.num_computed_tokens  # after this step's tokens
            for window, n in zip(self.windows, held, strict=True):
                if window is None:
                    assert n == -(-computed // bs), (request.request_id, held, computed)
                else:
                    # This step's tokens and the window of the first of them (of the
                    # earliest position a rollback of draft tokens may restart at).
                    limit = CHUNK + window + self.kv.num_rollback_tokens
                    assert n <= -(-limit // bs) + 1, (request.request_id, held)
                    self.max_sliding_held = max(self.max_sliding_held, n)


CASES = [
    # arch, sliding_window for the checkpoint (None: the architecture's own), block size,
    # attention backend, expected group windows
    ("mistral", 16, 8, "torch", [16]),
    ("mistral", 16, 4, "cpu", [16]),
    ("qwen2", 16, 8, "cpu", [None, 16]),
    ("gemma2", None, 4, "torch", [None, 8]),
    ("gemma3", None, 4, "torch", [None, 8]),
    ("gemma3", None, 8, "cpu", [None, 8]),
]


@pytest.mark.parametrize(("arch", "window", "block_size", "backend", "groups"), CASES)
def test_window_only_cache_matches_transformers(
    checkpoint_factory, arch, window, block_size, backend, groups
) -> None:
    path = checkpoint_factory(arch, sliding_window=window)
    prompts = _prompts(2, [70, 5, 33, 21, 52, 12], shared=24)
    with LLM(
        path,
        dtype="float32",
        multiprocessing=False,
        max_num_batched_tokens=CHUNK,
        max_num_seqs=8,  # else the budget is raised to max_num_seqs
        block_size=block_size,
        prefix_caching=True,
        attention_backend=backend,
    ) as llm:
        watch = _GroupWatch(llm)
        assert watch.windows == groups
        # The first request fills the prefix cache; the batch then hits it.
        llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=1))
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
        )
        assert watch.kv.leak_report() == []
    assert watch.max_sliding_held > 0
    assert any(o.num_cached_tokens > 0 for o in outputs), "no prefix-cache hit"
    for prompt, out in zip(prompts, outputs, strict=True):
        assert_matches_reference(
            out.outputs[0].token_ids,
            greedy_reference(path, prompt, MAX_TOKENS),
            f"{arch}/{backend} prompt of {len(prompt)}",
        )


@pytest.mark.parametrize(
    ("arch", "window", "num_blocks"), [("mistral", 16, 20), ("gemma3", None, 48)]
)
def test_preempted_and_recomputed_past_the_window(
    checkpoint_factory, arch, window, num_blocks
) -> None:
    """A KV budget too small for the batch: requests are preempted, recomputed from
    scratch (their released blocks are gone) and still give transformers' tokens."""
    path = checkpoint_factory(arch, sliding_window=window)
    prompts = _prompts(5, [60, 48, 55, 40], shared=0)
    with LLM(
        path,
        dtype="float32",
        multiprocessing=False,
        max_num_batched_tokens=CHUNK,
        max_num_seqs=8,  # else the budget is raised to max_num_seqs
        block_size=4,
        prefix_caching=True,
        num_blocks_override=num_blocks,
    ) as llm:
        watch = _GroupWatch(llm)
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        )
    assert watch.preemptions > 0
    for prompt, out in zip(prompts, outputs, strict=True):
        assert_matches_reference(
            out.outputs[0].token_ids, greedy_reference(path, prompt, 40), f"{arch} preempted"
        )


def test_gemma3_pattern_groups_share_one_tensor_and_size_the_cache(tmp_path) -> None:
    """Gemma 3's five sliding layers per global one: six groups of one layer, all on one
    cache tensor, so a block costs one layer's K/V and the same bytes give six times the
    blocks of a cache that keeps every layer's every position."""
    from enginecore.checkpoints import make_random_checkpoint

    types = ["sliding_attention"] * 5 + ["full_attention"]
    path = make_random_checkpoint(
        tmp_path / "gemma3-6",
        arch="gemma3",
        config_overrides={"num_hidden_layers": 6, "layer_types": types},
    )
    block_size, kv_heads, head_dim = 4, 2, 32
    layer_block_bytes = 2 * block_size * kv_heads * head_dim * 4  # K and V, float32
    kv_bytes = 400 * layer_block_bytes
    prompts = _prompts(7, [45, 30, 38], shared=16)
    with LLM(
        path,
        dtype="float32",
        multiprocessing=False,
        max_num_batched_tokens=CHUNK,
        max_num_seqs=8,
        block_size=block_size,
        prefix_caching=True,
        kv_cache_bytes=kv_bytes,
    ) as llm:
        watch = _GroupWatch(llm)
        [(slots, tensors)] = llm.collective_rpc(
            lambda w: (
                w.model_runner._layer_slots,
                len({c.data_ptr() for c in w.model_runner.kv_caches}),
            )
        )
        num_blocks = llm.engine_client.engine.num_blocks
        llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=1))
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
        )
    assert watch.windows == [None, 8, 8, 8, 8, 8]
    assert slots == [0] * 6 and tensors == 1
    assert num_blocks == 400
    assert any(o.num_cached_tokens > 0 for o in outputs), "no prefix-cache hit"
    for prompt, out in zip(prompts, outputs, strict=True):
        assert_matches_reference(
            out.outputs[0].token_ids, greedy_reference(path, prompt, MAX_TOKENS), "gemma3 5:1"
        )


def test_speculative_rollback_keeps_the_window(checkpoint_factory) -> None:
    """n-gram drafts on repetitive prompts: rejected drafts roll ``num_computed_tokens``
    back, and the sliding group still holds the window of where it restarts."""
    path = checkpoint_factory("mistral", sliding_window=16)
    prompts = [list(range(100, 120)) * 3, list(range(300, 310)) * 4]
    with LLM(
        path,
        dtype="float32",
        multiprocessing=False,
        max_num_batched_tokens=CHUNK,
        max_num_seqs=8,
        block_size=4,
        speculative_method="ngram",
        num_speculative_tokens=3,
    ) as llm:
        watch = _GroupWatch(llm)
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        )
    assert watch.draft_steps > 0
    for prompt, out in zip(prompts, outputs, strict=True):
        assert_matches_reference(
            out.outputs[0].token_ids, greedy_reference(path, prompt, 40), "mistral ngram"
        )
