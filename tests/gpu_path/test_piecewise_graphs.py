"""Piecewise graphs (``builtin_models/enginecore_models/piecewise_graphs.py``) on a CPU:
the forward cut at its attention ops, padded to a captured token count, with attention
run eager between the pieces, gives transformers' tokens for mixed batches with chunked
prefill; the capture plan covers the sizes it claims; a capture records one piece more
than the model has attention layers and reuses one attention buffer.
``benchmarks/gpu_check.py`` captures and replays the pieces on a GPU."""

from __future__ import annotations

from enginecore import SamplingParams
from enginecore.layers import Attention
from enginecore_models.piecewise_graphs import (
    PIECEWISE,
    TOO_MANY_TOKENS,
    EagerSeam,
    PiecewiseGraphs,
    piecewise_plan,
    token_sizes,
)
from tests.helpers.hf_reference import assert_matches_reference, greedy_reference
from tests.helpers.model_runner import PROMPTS, driver_for, make_runner


def test_token_sizes_cover_every_count_up_to_the_largest():
    assert token_sizes(2048) == [8, 16, 32, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512]
    assert token_sizes(100) == [8, 16, 32, 64, 96, 100]
    assert token_sizes(5) == [5]
    for top in (5, 100, 300, 2048):
        sizes = token_sizes(top)
        assert sizes == sorted(set(sizes))
        for n in range(1, sizes[-1] + 1):
            size, outcome = piecewise_plan(n, sizes)
            assert outcome == PIECEWISE and size is not None and n <= size
            assert size == min(s for s in sizes if s >= n)  # the smallest that holds it
        assert piecewise_plan(sizes[-1] + 1, sizes) == (None, TOO_MANY_TOKENS)


def test_mixed_chunked_steps_through_the_split_match_transformers(tiny_llama, model_refs):
    runner = make_runner(tiny_llama, model_refs, max_num_batched_tokens=64)
    pieces = PiecewiseGraphs(runner, runner.kv_caches, EagerSeam())
    runner.piecewise_graphs = pieces
    # A 20-token budget: long prompts in chunks beside decoding rows, padded to 32.
    driver = driver_for(runner, budget=20)
    prompts = {"a": PROMPTS["a"], "b": PROMPTS["b"], "c": PROMPTS["c"]}
    for name, prompt in prompts.items():
        driver.add(name, prompt, max_tokens=10, params=SamplingParams(temperature=0.0))
    done = driver.run()
    for name, prompt in prompts.items():
        assert_matches_reference(done[name], greedy_reference(tiny_llama, prompt, 10), name)
    assert pieces.counts[PIECEWISE] >= 3  # every step with a prefill row went through it
    assert 20 not in pieces.sizes  # ... padded


def test_capture_records_a_piece_per_cut_and_one_buffer(tiny_llama, model_refs):
    runner = make_runner(tiny_llama, model_refs, max_num_batched_tokens=16)
    pieces = PiecewiseGraphs(runner, runner.kv_caches, EagerSeam())
    before = [c.clone() for c in runner.kv_caches]
    pieces.capture()
    layers = [m for m in runner.model.modules() if isinstance(m, Attention)]
    assert sorted(pieces.captured) == pieces.sizes == [8, 16]
    for size, captured in pieces.captured.items():
        assert len(captured.pieces) == len(layers) + 1
        assert [c.layer for c in captured.calls] == layers
        assert all(c.query.shape[0] == size for c in captured.calls)
        assert captured.hidden.shape[0] == size
    # One attention buffer, shared by every layer and size.
    assert len(pieces.outs) == 1
    (buffer,) = pieces.outs.values()
    assert buffer.shape[0] == 16
    for captured in pieces.captured.values():
        assert all(c.out.data_ptr() == buffer.data_ptr() for c in captured.calls)
    # Capturing runs no attention: the KV cache is untouched.
    assert all(bool((a == b).all()) for a, b in zip(before, runner.kv_caches, strict=True))
