"""The decode mirror's plan for a step with the same rows as the last one reuses the
lengths it read (no list conversion, no second pass); a step where rows leave or join
takes the general pass. Both give the order and lengths a fresh mirror gives."""

from __future__ import annotations

import numpy as np
import torch

from enginecore_cpu.decode_mirror import DecodeMirror


def mirror() -> DecodeMirror:
    return DecodeMirror(1, 1, 8, torch.float32, torch.device("cpu"), 1 << 24, 64, 8)


def plan(m: DecodeMirror, lens: dict[str, int]) -> tuple[list[str], list[int], list[int]]:
    caches = [torch.zeros(2, 16, 4, 1, 8)]
    lengths = np.fromiter(lens.values(), np.int64, len(lens))
    order = m.plan(list(lens), lengths, lambda r: list(range(4)), caches)
    assert order is not None and m.step is not None
    return order, m.step.write_pos.tolist(), m.step.lens.tolist()


def test_steady_plan_reuses_lengths_and_matches_a_fresh_mirror() -> None:
    m = mirror()
    lens = {"a": 3, "b": 7, "c": 5}
    plan(m, lens)
    for _ in range(3):  # steady: every row one position longer
        lens = {r: n + 1 for r, n in lens.items()}
        kept = m._row_len_array
        order, write_pos, after = plan(m, lens)
        assert kept is not None, "the steady plan did not find the last plan's lengths"
        assert write_pos == [lens[r] for r in order] and after == [lens[r] + 1 for r in order]
        assert np.array_equal(m._row_len_array, np.asarray(after))
    # "b" leaves, "d" joins: the general pass; rows and lengths as a fresh mirror's
    lens = {"a": lens["a"] + 1, "c": lens["c"] + 1, "d": 2}
    order, write_pos, after = plan(m, lens)
    assert sorted(order) == ["a", "c", "d"]
    assert write_pos == [lens[r] for r in order] and m.row_len == after
    fresh = mirror()
    _, fresh_pos, fresh_after = plan(fresh, {r: lens[r] for r in order})
    assert (fresh_pos, fresh_after) == (write_pos, after)
    # a request whose length does not follow (preempted and resumed) is a stale row
    lens = {"a": lens["a"] + 1, "c": 1, "d": lens["d"] + 1}
    order, write_pos, _ = plan(m, lens)
    assert write_pos == [lens[r] for r in order]
