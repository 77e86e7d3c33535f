"""The LoRA path CUDA graphs replay, checked on the CPU.

A graph replays fixed kernels over fixed tensors: the delta must read the step's
adapters from a persistent device buffer, with no host read and no shape that depends
on the mix. ``DenseLoRAKernels`` equal the grouped reference on any mix; on ``meta``
tensors (which refuse every read of a value) they still run, so they read nothing on
the host; ``LoRAGraphInputs`` feeds a captured layer a new mix by refilling its buffer
only; and a whole model computed with the dense kernels gives PEFT's greedy tokens.
The capture itself is covered by ``benchmarks/gpu_check.py``'s LoRA stage.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from enginecore import LLM, SamplingParams
from enginecore.lora.dense_kernels import DenseLoRAKernels
from enginecore.lora.graph_inputs import LoRAGraphInputs
from enginecore.lora.layer import LoRAStepState
from enginecore.lora.mapping import build_mapping
from enginecore.lora.random_adapter import make_random_adapter
from enginecore.lora.torch_kernels import TorchLoRAKernels
from enginecore.lora_request import LoRARequest

SLOTS, WIDTH, IN, OUT = 3, 8, 24, 20


def stacks(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B stacks as ``LoRALayer`` keeps them (B slot-minor)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(SLOTS, WIDTH, IN, generator=gen)
    b = torch.randn(OUT, SLOTS, WIDTH, generator=gen).permute(1, 0, 2)
    return a, b


def delta(kernels, x, a, b, mapping) -> torch.Tensor:
    y = torch.zeros(x.shape[0], OUT)
    if mapping is not None:
        kernels.expand(y, kernels.shrink(x, a, mapping), b, mapping)
    return y


@pytest.mark.parametrize("seed", range(4))
def test_dense_kernels_equal_the_grouped_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    request_slots = rng.integers(-1, SLOTS, size=7)
    request_slots[0] = 1  # at least one adapter row
    query_lens = rng.integers(1, 5, size=7)
    mapping = build_mapping(request_slots, query_lens, torch.device("cpu"))
    x = torch.randn(int(query_lens.sum()), IN, generator=torch.Generator().manual_seed(seed))
    a, b = stacks(seed)
    want = delta(TorchLoRAKernels(), x, a, b, mapping)
    got = delta(DenseLoRAKernels(), x, a, b, mapping)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    no_adapter = mapping.token_slots < 0
    assert no_adapter.any() and not got[no_adapter].any()  # base rows get nothing


def test_dense_kernels_read_nothing_on_the_host() -> None:
    """Meta tensors have shapes but no values: ``.item()``, ``nonzero``, boolean
    indexing or a host copy raise on them. The mapping's host-side grouping (segments)
    is left empty: the dense kernels need only the device slots."""
    mapping = build_mapping(np.array([0, -1, 2]), np.array([1, 1, 1]), torch.device("cpu"))
    assert mapping is not None
    a, b = stacks(0)
    meta = type(mapping)(
        token_slots=mapping.token_slots.to("meta"),
        sorted_rows=mapping.token_slots[:0].to("meta"),
        segments=(),  # the host-side grouping a graph cannot follow: left empty
        num_tokens=3,
    )
    kernels = DenseLoRAKernels()
    x, y = torch.empty(3, IN, device="meta"), torch.empty(3, OUT, device="meta")
    buf = kernels.shrink(x, a.to("meta"), meta)
    kernels.expand(y, buf, b.to("meta"), meta)
    assert buf.shape == (3, WIDTH) and y.shape == (3, OUT)


class Projection:
    """One LoRA projection's delta as a layer computes it: the step state's kernels and
    mapping, read at call time (what a graph captures)."""

    def __init__(self, state: LoRAStepState, a: torch.Tensor, b: torch.Tensor) -> None:
        self.state, self.a, self.b = state, a, b

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return delta(self.state.kernels, x, self.a, self.b, self.state.mapping)


def test_graph_inputs_replay_a_new_mix_by_refilling_the_buffer() -> None:
    """Capture once over the persistent buffer; each later step only refills it (rows
    past the step padded with ``-1``) and the same captured call gives that step's
    delta. A step without adapters asks for the plain graph."""
    state = LoRAStepState(TorchLoRAKernels())
    a, b = stacks(1)
    projection = Projection(state, a, b)
    inputs = LoRAGraphInputs(state, max_rows=8, device=torch.device("cpu"))
    rows = 8
    x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(3))
    with inputs.capturing(rows, with_lora=True):
        captured_kernels, captured_mapping = state.kernels, state.mapping
        assert isinstance(captured_kernels, DenseLoRAKernels)
        assert captured_mapping.token_slots.data_ptr() == inputs.token_slots.data_ptr()
    with inputs.capturing(rows, with_lora=False):
        assert state.mapping is None  # the plain graph runs no LoRA code
    assert isinstance(state.kernels, TorchLoRAKernels)  # restored after capture

    for step_slots in ([2, -1, 0, 2, 1], [0], [-1, 1, 1, 1, 1, 0, 2]):
        n = len(step_slots)
        state.mapping = build_mapping(np.array(step_slots), np.ones(n, np.int64), x.device)
        want = Projection(state, a, b)(x[:n])  # eager, grouped
        assert inputs.fill(rows)
        # "Replay": what was captured, over the buffer, with nothing else refreshed.
        saved = state.kernels, state.mapping
        state.kernels, state.mapping = captured_kernels, captured_mapping
        got = projection(x)
        state.kernels, state.mapping = saved
        torch.testing.assert_close(got[:n], want, rtol=1e-5, atol=1e-4)
        assert not got[n:].any()  # padding rows: no adapter
    state.mapping = None
    assert not inputs.fill(rows)  # base-only step: the plain graph


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> list[LoRARequest]:
    root = tmp_path_factory.mktemp("dense")
    shapes = [(8, ("q_proj", "v_proj")), (4, ("o_proj", "gate_proj", "down_proj"))]
    return [
        LoRARequest(
            f"a{i}",
            i + 1,
            str(make_random_adapter(tiny_llama, root / f"a{i}", r=r, target_modules=t, seed=i)),
        )
        for i, (r, t) in enumerate(shapes)
    ]


def test_a_model_on_the_dense_kernels_gives_peft_tokens(tiny_llama, adapters) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    rng = random.Random(7)
    prompts = [[rng.randrange(10, 8192) for _ in range(6 + 3 * i)] for i in range(3)]
    per_prompt = [None, *adapters]
    with LLM(
        tiny_llama,
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        num_blocks_override=64,
        multiprocessing=False,
    ) as llm:
        runner = llm.engine_client.engine.executor.worker.model_runner
        runner.lora.state.kernels = DenseLoRAKernels()  # every step, prefill and decode
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
            lora_request=per_prompt,
            use_tqdm=False,
        )
    for prompt, lora, out in zip(prompts, per_prompt, outputs, strict=True):
        model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
        if lora is not None:
            model = PeftModel.from_pretrained(model, lora.lora_path)
        with torch.inference_mode():
            want = model.eval().generate(
                torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0,
                eos_token_id=None,
            )  # fmt: skip
        assert out.outputs[0].token_ids == want[0, len(prompt) :].tolist()
