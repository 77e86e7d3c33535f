"""Beam search (``LLM.beam_search``; the server's ``use_beam_search`` runs the same module):
against transformers' ``generate(num_beams=...)`` where the two define beam search alike,
and against a reference of vLLM's semantics computed from transformers' logprobs where
they differ (EOS handling, length penalty).

transformers and vLLM agree when no beam ends: both keep, at each step, the ``W``
extensions with the highest cumulative logprob, so with EOS out of play (``ignore_eos``
here, no EOS in transformers) the returned beams are the same. They differ once beams
end: transformers finishes only EOS candidates ranked among the top ``W`` and scores by
the generated length, vLLM finishes every EOS candidate among each beam's top ``2W``
and scores by the whole length (prompt included). That case is checked against
:func:`reference_beam_search`, vLLM's algorithm over transformers' own logprobs.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from enginecore import LLM, BeamSearchParams, InvalidRequestError
from enginecore.engine.beam_search import BeamSearch
from tests.helpers.hf_reference import load_reference

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with LLM(tiny_llama, dtype="float32", multiprocessing=False, num_blocks_override=256) as llm:
        yield llm


def _hf_logprobs(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1)


def reference_beam_search(
    model,
    prompt: list[int],
    width: int,
    max_tokens: int,
    eos_ids: set[int],
    length_penalty: float,
) -> list[tuple[list[int], float]]:
    """vLLM's frontend beam search, over transformers' logprobs: each step, every live
    beam's top ``2 * width`` extensions; EOS ones finish, the best ``width`` others live."""

    def score(beam: tuple[list[int], float]) -> float:
        tokens, cum = beam
        length = len(tokens) - (1 if tokens[-1] in eos_ids else 0)
        return cum / length**length_penalty

    live = [(list(prompt), 0.0)]
    finished: list[tuple[list[int], float]] = []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in live:
            top = torch.topk(_hf_logprobs(model, tokens), 2 * width)
            for logprob, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                child = ([*tokens, token], cum + logprob)
                (finished if token in eos_ids else candidates).append(child)
        live = sorted(candidates, key=score, reverse=True)[:width]
        if not live:
            break
    return sorted(finished + live, key=score, reverse=True)[:width]


@pytest.mark.parametrize("width", [1, 3])
def test_beams_match_transformers_generate(llm, tiny_llama, width):
    """No beam ends (ignore_eos; no EOS in transformers): the same W beams, in order."""
    prompt = llm.tokenizer.encode(PROMPT)
    max_tokens = 6
    (result,) = llm.beam_search(
        [prompt],
        BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True),
    )
    model = load_reference(str(tiny_llama))
    generated = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        max_new_tokens=max_tokens,
        length_penalty=1.0,
        early_stopping=width > 1,
        eos_token_id=None,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    expected = [row.tolist() for row in generated.sequences]
    ours = [seq.tokens for seq in result.sequences]
    assert ours == expected
    if width > 1:  # one beam is greedy search: transformers gives no beam scores then
        # transformers' sequences_scores are cum_logprob / generated_len ** length_penalty.
        scores = generated.sequences_scores.tolist()
        for seq, hf_score in zip(result.sequences, scores, strict=True):
            assert seq.cum_logprob / max_tokens == pytest.approx(hf_score, abs=1e-4)
    for seq in result.sequences:
        assert seq.text == llm.tokenizer.decode(seq.tokens[len(prompt) :])
        assert seq.finish_reason == "length"


@pytest.fixture(scope="module")
def eos_checkpoint(tiny_llama, tmp_path_factory):
    """The tiny model with a likely token declared an extra EOS (generation_config.json),
    so that beams do end: the token transformers' greedy search picks at its third step."""
    model = load_reference(str(tiny_llama))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    prompt = tokenizer.encode(PROMPT)
    greedy = model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=3, eos_token_id=None
    )
    extra_eos = int(greedy[0, -1])
    path = tmp_path_factory.mktemp("beam-eos") / "ckpt"
    shutil.copytree(tiny_llama, path)
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen["eos_token_id"] = [tokenizer.eos_token_id, extra_eos]
    gen_path.write_text(json.dumps(gen))
    return path, {tokenizer.eos_token_id, extra_eos}, prompt


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_finished_beams_follow_vllm_semantics(eos_checkpoint, tiny_llama, length_penalty):
    path, eos_ids, prompt = eos_checkpoint
    width, max_tokens = 3, 6
    with LLM(path, dtype="float32", multiprocessing=False, num_blocks_override=256) as llm:
        (result,) = llm.beam_search(
            [prompt],
            BeamSearchParams(
                beam_width=width, max_tokens=max_tokens, length_penalty=length_penalty
            ),
        )
    expected = reference_beam_search(
        load_reference(str(tiny_llama)), prompt, width, max_tokens, eos_ids, length_penalty
    )
    assert [seq.tokens for seq in result.sequences] == [tokens for tokens, _ in expected]
    for seq, (_, cum) in zip(result.sequences, expected, strict=True):
        assert seq.cum_logprob == pytest.approx(cum, abs=1e-3)
    ended = [seq for seq in result.sequences if seq.tokens[-1] in eos_ids]
    assert ended, "the extra EOS must end at least one of the best beams"
    for seq in ended:
        assert seq.finish_reason == "stop"


def _run_counting_steps(llm, prompt, params) -> tuple[BeamSearch, int]:
    """The search ``LLM.beam_search`` runs, driven here to count its steps."""
    search = BeamSearch([prompt], params, llm.input_processor.eos_ids, llm.max_model_len)
    steps = 0
    while not search.done:
        step = [{"prompt_token_ids": t} for t in search.step_prompts()]
        search.advance(llm.generate(step, search.step_params, use_tqdm=False))
        steps += 1
    return search, steps


def test_early_stopping_ends_once_width_beams_finished(eos_checkpoint):
    """``early_stopping``: the search stops at the step where W beams have ended; without
    it, it runs all ``max_tokens`` steps."""
    path, _, prompt = eos_checkpoint
    width, max_tokens = 2, 12
    with LLM(path, dtype="float32", multiprocessing=False, num_blocks_override=256) as llm:
        _, full_steps = _run_counting_steps(
            llm, prompt, BeamSearchParams(beam_width=width, max_tokens=max_tokens)
        )
        early, early_steps = _run_counting_steps(
            llm,
            prompt,
            BeamSearchParams(beam_width=width, max_tokens=max_tokens, early_stopping=True),
        )
        assert full_steps == max_tokens
        assert early_steps < max_tokens
        assert len(early.instances[0].finished) >= width
        # One step earlier, fewer than W had ended (else it would have stopped there).
        before, _ = _run_counting_steps(
            llm,
            prompt,
            BeamSearchParams(beam_width=width, max_tokens=early_steps - 1, early_stopping=True),
        )
        assert len(before.instances[0].finished) < width
        (result,) = early.results(llm.tokenizer)
        (via_llm,) = llm.beam_search(
            [prompt],
            BeamSearchParams(beam_width=width, max_tokens=max_tokens, early_stopping=True),
        )
        assert [s.tokens for s in via_llm.sequences] == [s.tokens for s in result.sequences]


def test_several_prompts_and_text_prompts(llm):
    prompts = [PROMPT, "Hello there"]
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    together = llm.beam_search(prompts, params)
    alone = [llm.beam_search(p, params)[0] for p in prompts]
    assert len(together) == 2
    for both, one in zip(together, alone, strict=True):
        assert [s.tokens for s in both.sequences] == [s.tokens for s in one.sequences]
        scores = [s.cum_logprob for s in both.sequences]
        assert scores == sorted(scores, reverse=True)
        assert all(math.isfinite(s) for s in scores)


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("beam_width", {"beam_width": 0, "max_tokens": 4}),
        ("max_tokens", {"beam_width": 2, "max_tokens": 0}),
        ("temperature", {"beam_width": 2, "max_tokens": 4, "temperature": -1.0}),
    ],
)
def test_bad_params_name_the_field(field, kwargs):
    with pytest.raises(InvalidRequestError, match=field):
        BeamSearchParams(**kwargs)
