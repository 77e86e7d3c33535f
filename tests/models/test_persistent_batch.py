"""The persistent batch: rows kept across steps equal what a per-step rebuild gives.

Requests are added, finished (the rows condense), resumed and advanced by sampled
tokens; after each change the sampling metadata gathered from the rows (incremental
penalty counts included) must equal ``build_sampling_metadata`` over the requests'
lists, and the token rows must hold each request's prompt and outputs.
"""

from __future__ import annotations

import numpy as np
import torch

from enginecore import SamplingParams
from enginecore_models.persistent_batch import PersistentBatch
from enginecore_models.sampler import build_sampling_metadata

VOCAB = 50
EOS = [2]


def _to_device(name: str, values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values))


def _check(batch: PersistentBatch, reqs: dict[str, tuple[list[int], list[int], SamplingParams]]):
    order = sorted(reqs)
    rows = np.array([batch.row_of[r] for r in order], dtype=np.int64)
    assert sorted(batch.row_of.values()) == list(range(len(batch)))  # condensed
    for r, row in zip(order, rows.tolist(), strict=True):
        prompt, outputs, _ = reqs[r]
        n = int(batch.num_tokens[row])
        assert batch.tokens[row, :n].tolist() == prompt + outputs
    got = batch.sampling_metadata(rows, torch.from_numpy(rows), _to_device)
    want = build_sampling_metadata(
        [reqs[r][2] for r in order],
        [reqs[r][0] for r in order],
        [reqs[r][1] for r in order],
        [None] * len(order),
        EOS,
        VOCAB,
        torch.device("cpu"),
    )
    assert got.all_greedy == want.all_greedy
    assert got.top_k_max == want.top_k_max
    for name in (
        "greedy_rows",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "bias_rows",
        "bias_cols",
        "bias_values",
        "ban_rows",
        "ban_cols",
    ):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, msg=name)
    # Counts and prompt presence matter only where a penalty reads them: they are kept
    # for penalised rows only.
    penalised = [i for i, r in enumerate(order) if reqs[r][2].needs_penalties]
    for name in ("output_counts", "prompt_mask"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a[penalised], b[penalised], msg=name)
    assert got.max_num_logprobs == want.max_num_logprobs
    if want.max_num_logprobs is not None:
        assert got.num_logprobs == want.num_logprobs
        assert got.num_listed == want.num_listed
        assert (got.listed_ids is None) == (want.listed_ids is None)
        if want.listed_ids is not None:
            torch.testing.assert_close(got.listed_ids, want.listed_ids)


def test_rows_track_adds_finishes_and_sampled_tokens():
    batch = PersistentBatch(VOCAB, torch.device("cpu"), EOS)
    params = {
        "a": SamplingParams(temperature=0.0),
        "b": SamplingParams(temperature=0.7, top_k=5, presence_penalty=0.4, logprobs=2),
        "c": SamplingParams(temperature=1.0, top_p=0.8, frequency_penalty=0.3, min_tokens=4),
        "d": SamplingParams(temperature=0.5, repetition_penalty=1.3, logit_bias={7: 2.0}),
        "e": SamplingParams(temperature=0.9, min_p=0.1),
        "g": SamplingParams(temperature=0.0, logprob_token_ids=[4, 9, 60]),  # 60: no logit
    }
    reqs: dict[str, tuple[list[int], list[int], SamplingParams]] = {}
    rng = np.random.default_rng(0)
    for i, (r, p) in enumerate(params.items()):
        prompt = rng.integers(3, VOCAB, size=5 + i).tolist()
        outputs = rng.integers(3, VOCAB, size=i % 2).tolist()  # some resume with outputs
        reqs[r] = (prompt, outputs, p)
        batch.add(r, prompt, outputs, p, None)
    _check(batch, reqs)
    for step in range(6):
        order = sorted(reqs)
        rows = np.array([batch.row_of[r] for r in order], dtype=np.int64)
        tokens = rng.integers(0, VOCAB, size=len(order))
        batch.count_sampled(torch.from_numpy(rows), rows, torch.from_numpy(tokens))
        batch.append_sampled(rows, tokens)
        for r, t in zip(order, tokens.tolist(), strict=True):
            reqs[r][1].append(t)
        if step == 1:
            batch.remove(["b", "a"])  # the last rows move into the holes
            del reqs["b"], reqs["a"]
        if step == 3:
            p = SamplingParams(temperature=0.6, presence_penalty=1.0, frequency_penalty=0.2)
            reqs["f"] = ([4, 5, 6] * 40, [9, 9], p)  # a long one: the rows widen
            batch.add("f", *reqs["f"][:2], p, None)
        _check(batch, reqs)
