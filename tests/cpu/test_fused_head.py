"""The LM head inside the CPU backend's fused decode step (``decode_step.c``'s head
phases): the logits are ``compute_logits``' bits, and for plain greedy steps each row's
argmax is taken tile by tile in the call, as ``torch.argmax`` takes it (the first
maximum on ties, the first NaN, infinities), at every row count."""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from enginecore_cpu import cpu_kernels, decode_step
from tests.helpers.gguf_writer import write_gguf
from tests.helpers.hf_reference import greedy_reference

# An engine of its own: slow. The fast siblings: test_greedy_shortcut.py (the token path
# taken, transformers' tokens) and test_fused_decode.py (logits and log-probabilities).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler"),
]
TILE = 128  # decode_step.c's ECD_HEAD_TILE: the ties and NaNs below straddle tiles


@pytest.fixture(scope="module")
def engine(tiny_llama: pathlib.Path) -> Iterator[Any]:
    """One float32 engine in this process, on the torch threads its worker sets (this
    process's count is restored after)."""
    from enginecore import LLM

    decode_step.build()
    threads = torch.get_num_threads()
    try:
        with LLM(str(tiny_llama), multiprocessing=False, max_model_len=128) as llm:
            yield llm
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _runner(llm: Any) -> Any:
    return llm.collective_rpc(lambda w: w.model_runner)[0]


def _prompts(count: int) -> list[list[int]]:
    return [[(i * 37 + j) % 200 + 3 for j in range(3 + i % 7)] for i in range(count)]


def _decode(llm: Any, count: int, checks: list[tuple[torch.Tensor, torch.Tensor]]) -> list:
    """``count`` greedy requests that finish one by one (so the decode steps hold every
    row count from ``count`` down to 1); each fused token step's tokens and the same
    step's logits from the step (its K/V written again to the same places) go to
    ``checks``."""
    from enginecore import SamplingParams

    step = _runner(llm).fused_decode
    fused_run = step.run

    def checked(ids: Any, positions: Any, batch: Any, **head: Any) -> torch.Tensor:
        out: torch.Tensor = fused_run(ids, positions, batch, **head)
        if head.get("head") == "tokens":  # the runner's reused array: copied here
            checks.append((out.clone(), fused_run(ids, positions, batch, head="logits")))
        return out

    step.run = checked
    try:
        params = [
            SamplingParams(max_tokens=2 + i, temperature=0.0, ignore_eos=True) for i in range(count)
        ]
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts(count)], params)
    finally:
        del step.run
    return [list(o.outputs[0].token_ids) for o in outs]


def test_head_logits_are_compute_logits_bits(engine) -> None:
    """A step that needs logits (log-probabilities asked) gets the head's product from
    the call: the bits of ``compute_logits`` on one torch thread, on the step's hidden
    states, whatever the step's own team.

    The step multiplies each tile of the head by BLAS's sgemm on one thread, so its bits
    do not depend on its team. ``F.linear`` on several threads may split the batch's
    rows between them, and on some CPUs (AMD's among them) MKL multiplies a share of
    fewer than 4 rows by another kernel, summing in another order: against
    ``compute_logits`` on the engine's own threads the logits agree to float32
    rounding."""
    from enginecore import SamplingParams

    runner = _runner(engine)
    step = runner.fused_decode
    assert step is not None and step.has_head
    fused_run, compared = step.run, []

    def compare(ids: Any, positions: Any, batch: Any, **head: Any) -> torch.Tensor:
        out: torch.Tensor = fused_run(ids, positions, batch, **head)
        if head.get("head") == "logits":
            hidden = fused_run(ids, positions, batch)
            with _one_torch_thread():
                compared.append(torch.equal(out, runner.model.compute_logits(hidden)))
            torch.testing.assert_close(
                out, runner.model.compute_logits(hidden), rtol=1e-6, atol=1e-5
            )
        return out

    step.run = compare
    before = step.logits_steps
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
        engine.generate([{"prompt_token_ids": p} for p in _prompts(5)], params)
    finally:
        del step.run
    assert step.logits_steps - before >= 5 and compared and all(compared), compared


def test_head_tokens_are_the_logits_argmax_at_every_row_count(engine, tiny_llama) -> None:
    """Plain greedy steps take the argmax in the call (no logits): the tokens are
    ``torch.argmax`` of the step's logits at 1 to 34 rows, and transformers' greedy
    tokens."""
    runner = _runner(engine)
    before = runner.fused_decode.token_steps
    checks: list[tuple[torch.Tensor, torch.Tensor]] = []
    outs = _decode(engine, 34, checks)
    rows = sorted({tokens.shape[0] for tokens, _ in checks})
    assert rows == list(range(1, 35)), rows
    assert runner.fused_decode.token_steps - before >= 34
    for tokens, logits in checks:
        assert torch.equal(tokens, logits.argmax(dim=-1))
    for prompt, out in zip(_prompts(34)[:6], outs[:6], strict=True):
        reference, first_tie = greedy_reference(tiny_llama, prompt, len(out))
        assert out[:first_tie] == reference[:first_tie]


@pytest.mark.parametrize("case", ["ties", "nan", "inf"])
def test_head_argmax_breaks_ties_nans_and_infinities_as_torch(engine, case) -> None:
    """Head rows edited so the logits hold equal maxima in different tiles (and a zero
    column for the rows where they are negative), NaNs in two tiles, or infinities of
    either sign: the tokens are ``torch.argmax``'s of the step's own logits."""
    weight = _runner(engine).model.logits_head().weight
    vocab = weight.shape[0]
    assert vocab > 8 * TILE, vocab
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            if case == "ties":  # rows a and b equal, every other row zero
                weight.zero_()
                weight[TILE - 1] = saved[3]
                weight[5 * TILE] = saved[3]
            elif case == "nan":
                weight[3 * TILE + 7, 0] = float("nan")
                weight[6 * TILE, 1] = float("nan")
            else:  # one component infinite: +inf or -inf by the hidden state's sign
                weight[2 * TILE + 1] = 0.0
                weight[2 * TILE + 1, 0] = float("inf")
                weight[7 * TILE - 1] = 0.0
                weight[7 * TILE - 1, 0] = float("inf")
        checks: list[tuple[torch.Tensor, torch.Tensor]] = []
        _decode(engine, 18, checks)
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert {tokens.shape[0] for tokens, _ in checks} >= {1, 16, 17, 18}
    special = {"ties": {TILE - 1}, "nan": {3 * TILE + 7}, "inf": {2 * TILE + 1}}[case]
    picked = set()
    for tokens, logits in checks:
        assert torch.equal(tokens, logits.argmax(dim=-1)), case
        picked |= set(tokens.tolist())
    assert picked & special, (case, sorted(picked))  # the edited rows were the maxima


def test_gguf_head_in_the_step_gives_the_layers_greedy_tokens(tiny_llama, tmp_path, monkeypatch):
    """A GGUF file's head (its blocks, multiplied by the one-row kernels) inside the
    step: the greedy tokens of the layer-by-layer path and its ``compute_logits``."""
    from enginecore import LLM, SamplingParams

    path = write_gguf(tiny_llama, tmp_path / "q8.gguf", types=lambda name: "Q8_0")
    answers, taken = [], 0
    for fused in ("1", "0"):
        monkeypatch.setenv("ENGINECORE_FUSED_DECODE", fused)
        with LLM(str(path), multiprocessing=False, max_model_len=128) as llm:
            params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
            outs = llm.generate([{"prompt_token_ids": p} for p in _prompts(6)], params)
            answers.append([list(o.outputs[0].token_ids) for o in outs])
            step = _runner(llm).fused_decode
            taken = taken or (step.token_steps if step is not None else 0)
    assert taken >= 9 and answers[0] == answers[1]


LLAMA3_VOCAB = 128_256  # Llama 3's head rows: a thousand tiles, token ids past 2**16


@pytest.mark.parametrize("fmt", ["Q4_0", "Q8_0"])
def test_llama3_wide_head_in_the_step(tmp_path, monkeypatch, fmt):
    """A head of Llama 3's 128,256 rows in the file's blocks, on a small hidden size:
    the step's in-call argmax is ``torch.argmax`` of the step's own logits at every row
    count, and its greedy tokens (ids past 2**16 among them) are the layers'."""
    from enginecore import LLM, SamplingParams
    from enginecore.checkpoints import make_random_checkpoint

    checkpoint = make_random_checkpoint(  # an output head of its own, as Llama 3's
        tmp_path / "wide", config_overrides={"vocab_size": LLAMA3_VOCAB}
    )
    path = write_gguf(checkpoint, tmp_path / "wide.gguf", types=lambda name: fmt)
    decode_step.build()  # the step's library, which the engine would build in the background
    answers = []
    for fused in ("1", "0"):
        monkeypatch.setenv("ENGINECORE_FUSED_DECODE", fused)
        with LLM(str(path), multiprocessing=False, max_model_len=64) as llm:
            if fused == "1":
                step = _runner(llm).fused_decode
                assert step is not None and step.has_head
                checks: list[tuple[torch.Tensor, torch.Tensor]] = []
                answers.append(_decode(llm, 5, checks))
                assert {tokens.shape[0] for tokens, _ in checks} == {1, 2, 3, 4, 5}
                for tokens, logits in checks:
                    assert logits.shape[1] == LLAMA3_VOCAB
                    assert torch.equal(tokens, logits.argmax(dim=-1))
            else:  # the layers, the same requests
                assert _runner(llm).fused_decode is None
                params = [
                    SamplingParams(max_tokens=2 + i, temperature=0.0, ignore_eos=True)
                    for i in range(5)
                ]
                outs = llm.generate([{"prompt_token_ids": p} for p in _prompts(5)], params)
                answers.append([list(o.outputs[0].token_ids) for o in outs])
    assert answers[0] == answers[1]
    assert max(t for out in answers[0] for t in out) >= 2**16, answers[0]
