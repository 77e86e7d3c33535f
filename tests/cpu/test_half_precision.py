"""A bfloat16 model on CPU: greedy output equals transformers' bfloat16 generate.

On a CPU with AVX512-BF16 or AMX the runner keeps the projections in bfloat16 (the
``cpu_packed`` linear method); elsewhere it stores them in float32 and rounds each output
back to bfloat16. Either
way the tokens must be transformers' up to its first near tie: two bfloat16 logits two
rounding steps apart (``hf_reference.half_precision_tie``).
"""

from __future__ import annotations

import pytest
import torch

from enginecore import LLM, SamplingParams
from enginecore_cpu import bf16_gemv, cpu_kernels
from enginecore_cpu.linear_method import project
from tests.helpers.hf_reference import assert_matches_reference, greedy_reference
from tests.helpers.prompts import mixed_prompts

PROJECTIONS = {"ColumnParallelLinear", "RowParallelLinear", "MergedColumnParallelLinear"}
PROJECTIONS |= {"QKVParallelLinear", "ParallelLMHead"}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_bfloat16_batch_matches_transformers(checkpoint_factory, arch: str) -> None:
    path = checkpoint_factory(arch)
    prompts = mixed_prompts(3)[:8]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(path, dtype="bfloat16", multiprocessing=False, max_num_batched_tokens=64) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        summary = llm.collective_rpc("model_summary")[0]
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        reference = greedy_reference(path, prompt, 12, torch.bfloat16)
        assert_matches_reference(out.outputs[0].token_ids, reference, f"{arch} prompt {i}")

    widened = not cpu_kernels.cpu_has_amx() and bf16_gemv.load() is None
    for layer in summary["layers"]:
        dtypes = {p["dtype"] for p in layer["parameters"].values()}
        if layer["type"] in PROJECTIONS:
            weight = layer["parameters"]["weight"]["dtype"]
            assert weight == ("float32" if widened else "bfloat16"), layer
        else:  # embeddings and norms keep the model's dtype
            assert dtypes == {"bfloat16"}, layer


def test_project_rounds_a_widened_projection_once() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen).bfloat16()
    weight = torch.randn(32, 64, generator=gen).bfloat16()
    bias = torch.randn(32, generator=gen).bfloat16()
    out = project(x, weight.float(), bias)
    assert out.dtype == torch.bfloat16
    exact = x.double() @ weight.double().T + bias.double()
    # float32 accumulation, one rounding to bfloat16: within one bfloat16 step of exact
    step = 2.0 ** (torch.frexp(exact).exponent - 8)
    assert ((out.double() - exact).abs() <= step).all()
    assert torch.equal(project(x, weight, bias), torch.nn.functional.linear(x, weight, bias))
