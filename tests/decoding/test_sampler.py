"""The batched sampler: each option against a direct computation."""

from __future__ import annotations

import math

import pytest
import torch

from enginecore.errors import InvalidRequestError
from enginecore.params import SamplingParams
from enginecore_models.sampler import (
    Sampler,
    apply_grammar_bitmask,
    apply_top_k_top_p,
    build_sampling_metadata,
)

V = 64
CPU = torch.device("cpu")


def meta_for(params, outputs=None, prompts=None, gens=None, eos=(1,)):
    n = len(params)
    return build_sampling_metadata(
        params,
        prompts or [[] for _ in range(n)],
        outputs or [[] for _ in range(n)],
        gens or [None] * n,
        list(eos),
        V,
        CPU,
    )


def sample(logits, params, **kw):
    return Sampler(torch.Generator().manual_seed(0))(logits, meta_for(params, **kw))


def test_all_greedy_is_argmax():
    logits = torch.randn(5, V)
    out = sample(logits, [SamplingParams(temperature=0.0)] * 5)
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_mixed_greedy_and_random_rows():
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=1),
        SamplingParams(),
        SamplingParams(temperature=0.0),
    ]
    out = sample(logits, params).token_ids
    assert out[0] == logits[0].argmax() and out[3] == logits[3].argmax()
    assert out[1] == logits[1].argmax()  # top_k=1 leaves only the argmax


def test_seeded_rows_do_not_depend_on_batch():
    torch.manual_seed(0)
    row = torch.randn(V)

    def run(batch_rows, position):
        logits = torch.stack(batch_rows)
        params = [SamplingParams(temperature=1.0) for _ in batch_rows]
        params[position] = SamplingParams(temperature=0.8, seed=1234)
        gens = [None] * len(batch_rows)
        tokens = []
        gens[position] = torch.Generator().manual_seed(1234)
        for _ in range(10):
            out = sample(logits, params, gens=gens)
            tokens.append(int(out.token_ids[position]))
        return tokens

    alone = run([row], 0)
    batched = run([torch.randn(V), torch.randn(V), row], 2)
    assert alone == batched
    assert len(set(alone)) > 1  # it really samples


def test_temperature_sampling_follows_softmax():
    logits = torch.tensor([math.log(0.6), math.log(0.3), math.log(0.1)] + [-1e9] * (V - 3))
    n = 4000
    out = sample(logits.repeat(n, 1), [SamplingParams(temperature=1.0)] * n).token_ids
    freq = torch.bincount(out, minlength=V)[:3].float() / n
    torch.testing.assert_close(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.03, rtol=0)


def test_top_p_keeps_the_nucleus():
    logits = torch.tensor([math.log(0.5), math.log(0.3), math.log(0.2)] + [-1e9] * (V - 3))
    n = 2000
    out = sample(logits.repeat(n, 1), [SamplingParams(top_p=0.6)] * n).token_ids
    assert set(out.tolist()) == {0, 1}  # 0.5 < 0.6, so the second token is needed too


def test_top_k_and_top_p_masks():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    masked = apply_top_k_top_p(logits, torch.tensor([2, 4]), None)
    assert torch.isinf(masked[0, 2:]).all() and torch.isfinite(masked[0, :2]).all()
    assert torch.isfinite(masked[1]).all()
    both = apply_top_k_top_p(logits, torch.tensor([3, 1]), torch.tensor([[0.99], [0.99]]))
    assert torch.isfinite(both[0, :3]).all() and torch.isinf(both[0, 3])
    assert torch.isfinite(both).sum(1)[1] == 1 and torch.isfinite(both[1, 3])


def test_min_p_drops_unlikely_tokens():
    logits = torch.tensor([math.log(0.5), math.log(0.45), math.log(0.05)] + [-1e9] * (V - 3))
    n = 2000
    out = sample(logits.repeat(n, 1), [SamplingParams(min_p=0.2)] * n).token_ids
    assert set(out.tolist()) == {0, 1}


def test_logit_bias_and_min_tokens():
    logits = torch.zeros(2, V)
    logits[:, 1] = 10.0  # EOS is by far the most likely
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, logit_bias={7: 5.0}),
        SamplingParams(temperature=0.0, logit_bias={9: 20.0}),
    ]
    out = sample(logits, params, outputs=[[4], []]).token_ids.tolist()
    assert out == [7, 9]  # row 0: EOS banned below min_tokens, bias picks 7
    out = sample(logits[:1], params[:1], outputs=[[4, 4, 4]]).token_ids.tolist()
    assert out == [1]  # min_tokens reached: EOS allowed again


def test_stop_token_ids_banned_below_min_tokens():
    logits = torch.zeros(1, V)
    logits[0, 5] = 10.0
    params = [SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5])]
    assert sample(logits, params, outputs=[[]]).token_ids.item() != 5


def test_penalties():
    logits = torch.tensor([[2.0, 2.0, -2.0, 1.0] + [0.0] * (V - 4)])
    params = [
        SamplingParams(
            temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0
        )
    ]
    meta = meta_for(params, outputs=[[0, 0, 2]], prompts=[[3]])
    from enginecore_models.sampler import apply_penalties

    got = apply_penalties(logits.clone(), meta)[0, :5]
    # token 0: seen (2x in output): 2/2 - 0.25*2 - 0.5 = 0.0
    # token 1: unseen: 2.0;  token 2: output once: -2*2 - 0.25 - 0.5 = -4.75
    # token 3: prompt only: 1/2 = 0.5 (presence/frequency count outputs only)
    torch.testing.assert_close(got, torch.tensor([0.0, 2.0, -4.75, 0.5, 0.0]))
    assert sample(logits, params, outputs=[[0, 0, 2]], prompts=[[3]]).token_ids.item() == 1


def test_logprobs_rows_from_raw_logits():
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=0, logit_bias={5: 100.0}),
    ]
    out = sample(logits, params)
    lp = out.logprobs
    ref = logits.log_softmax(-1)
    assert len(lp.logprob_token_ids[0]) == 4 and lp.logprob_token_ids[1] == []
    top = ref[0].topk(3)
    assert lp.logprob_token_ids[0][1:] == top.indices.tolist()
    assert lp.logprob_token_ids[0][0] == out.token_ids[0] and lp.sampled_token_ranks[0] == 1
    torch.testing.assert_close(torch.tensor(lp.logprobs[0][1:]), top.values)
    # Row 2 sampled token 5 because of the bias; its logprob and rank are the raw ones.
    assert lp.logprob_token_ids[2] == [5]
    assert math.isclose(lp.logprobs[2][0], ref[2, 5].item(), abs_tol=1e-6)
    assert lp.sampled_token_ranks[2] == int((ref[2] > ref[2, 5]).sum()) + 1


def test_listed_logprob_token_ids_beside_top_k_rows():
    """vLLM's ``logprob_token_ids``: a row reports the sampled token, then exactly the ids
    it listed (in its order, however unlikely), while other rows keep their top-k."""
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    params = [
        SamplingParams(temperature=0.0, logprob_token_ids=[7, 3, 60]),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprob_token_ids=[11]),
    ]
    assert params[0].logprobs == 3  # left out: the listed ids' count, as vLLM counts them
    out = sample(logits, params)
    lp = out.logprobs
    ref = logits.log_softmax(-1)
    sampled = out.token_ids.tolist()
    assert lp.logprob_token_ids[0] == [sampled[0], 7, 3, 60]
    torch.testing.assert_close(torch.tensor(lp.logprobs[0][1:]), ref[0, [7, 3, 60]])
    assert lp.logprob_token_ids[1][1:] == ref[1].topk(2).indices.tolist()
    assert lp.logprob_token_ids[2] == [] and lp.logprob_token_ids[3] == [sampled[3], 11]
    assert math.isclose(lp.logprobs[3][1], ref[3, 11].item(), abs_tol=1e-6)


def test_logprob_token_ids_limits_in_vllms_words():
    with pytest.raises(InvalidRequestError, match="greater than max allowed: 128"):
        SamplingParams(logprob_token_ids=list(range(129)))
    with pytest.raises(InvalidRequestError, match="logprobs must equal len"):
        SamplingParams(logprobs=2, logprob_token_ids=[1])
    assert SamplingParams(logprob_token_ids=[]).logprob_token_ids is None


def test_grammar_bitmask():
    logits = torch.randn(2, 70)
    words = 3  # ceil(70 / 32)
    bitmask = torch.zeros(2, words, dtype=torch.int32)
    bitmask[0, 1] = 1 << 3  # token 35 only
    bitmask[1, 2] = 1 << 5  # token 69 only
    apply_grammar_bitmask(logits, torch.tensor([1, 0]), bitmask)
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [35]
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [69]
    # Bit 31 is the sign bit of an int32 word.
    logits = torch.randn(1, 64)
    apply_grammar_bitmask(
        logits, torch.tensor([0]), torch.tensor([[0, -(2**31)]], dtype=torch.int32)
    )
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [63]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["numpy-path", "torch-path"])
def test_grammar_bitmask_paths_agree(dtype):
    """float32 CPU logits take the numpy path, others the torch one: same result, for a
    subset of rows and for all rows in order, and a vocabulary wider than the bitmask
    (model padding) is forbidden past its width."""
    gen = torch.Generator().manual_seed(0)
    words = 4
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    for vocab, rows in ((100, [2, 0, 3]), (140, [0, 1, 2])):
        logits = torch.randn(max(rows) + 1, vocab, generator=gen, dtype=dtype)
        expected = logits.clone()
        for j, row in enumerate(rows):
            for token in range(vocab):
                word, bit = divmod(token, 32)
                if word >= words or not (int(bitmask[j, word]) >> bit) & 1:
                    expected[row, token] = float("-inf")
        apply_grammar_bitmask(logits, torch.tensor(rows), bitmask)
        assert torch.equal(logits, expected)
