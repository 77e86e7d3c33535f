"""Which steps replay a CUDA graph and why the others run eager: the logic behind
``DecodeGraphs`` (``builtin_models/enginecore_models/cuda_graphs.py``), which needs no
GPU; ``benchmarks/gpu_check.py`` captures and replays the graphs on one."""

from __future__ import annotations

import numpy as np

from enginecore.layers.attention import AttentionBatch
from enginecore_models.cuda_graphs import (
    MULTI_TOKEN_ROWS,
    REPLAYED,
    TOO_MANY_ROWS,
    bucket_sizes,
    step_graph_plan,
)


def _batch(query_lens: list[int]) -> AttentionBatch:
    q = np.array(query_lens, dtype=np.int64)
    decodes = 0
    while decodes < len(q) and q[decodes] == 1:
        decodes += 1
    return AttentionBatch(
        [f"r{i}" for i in range(len(q))],
        q,
        np.full(len(q), 40, dtype=np.int64),
        np.zeros((len(q), 4), dtype=np.int64),
        np.arange(int(q.sum()), dtype=np.int64),
        decodes,
    )


def test_buckets():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def test_decode_steps_pad_to_the_next_bucket():
    sizes = bucket_sizes(64)
    assert step_graph_plan(_batch([1]), sizes) == (1, REPLAYED)
    assert step_graph_plan(_batch([1] * 3), sizes) == (4, REPLAYED)
    assert step_graph_plan(_batch([1] * 17), sizes) == (32, REPLAYED)
    assert step_graph_plan(_batch([1] * 64), sizes) == (64, REPLAYED)


def test_other_steps_run_eager_saying_why():
    sizes = bucket_sizes(16)
    assert step_graph_plan(_batch([1, 1, 7]), sizes) == (None, MULTI_TOKEN_ROWS)  # mixed
    assert step_graph_plan(_batch([300]), sizes) == (None, MULTI_TOKEN_ROWS)  # prefill
    assert step_graph_plan(_batch([3, 3]), sizes) == (None, MULTI_TOKEN_ROWS)  # verify
    assert step_graph_plan(_batch([1] * 17), sizes) == (None, TOO_MANY_ROWS)
    assert step_graph_plan(_batch([]), sizes) == (None, TOO_MANY_ROWS)
