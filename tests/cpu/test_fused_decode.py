"""The CPU backend's fused decode step (``builtin_cpu/enginecore_cpu/decode_step.py``): a whole decode
step of a Llama-family model with block-quantized or float32 weights in one foreign call, whose
tokens and log-probabilities are the layer-by-layer path's bit for bit."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

from enginecore_cpu import cpu_kernels, decode_step, gguf_linear_method, quant_gemm, quant_kernels
from tests.helpers.fused_idle_cpu import idle_cpu_after
from tests.helpers.gguf_writer import write_gguf

needs_kernels = pytest.mark.skipif(
    cpu_kernels.load() is None or quant_kernels.load() is None, reason="no C compiler"
)
if cpu_kernels.load() is not None:
    # An engine whose cache lacks the step's library serves with the layers until its
    # background build lands (test_first_load.py); these tests want the step from the start.
    decode_step.build()
pytestmark = needs_kernels

# Prompts of different lengths, so steps hold one to four decoding rows, and mixed steps
# (a prompt's chunk beside decodes) take the layers in between.
PROMPTS = [list(range(3 + i, 3 + i + length)) for i, length in enumerate((5, 23, 41, 12))]


def _generate(
    path: pathlib.Path, fused: bool, monkeypatch, prompts: list[list[int]] = PROMPTS, **engine: Any
) -> tuple[list, Any]:
    """Each request's tokens and log-probabilities, and how many steps ran fused."""
    from enginecore import LLM, SamplingParams

    monkeypatch.setenv("ENGINECORE_FUSED_DECODE", "1" if fused else "0")
    llm = LLM(str(path), multiprocessing=False, max_num_batched_tokens=32, **engine)
    try:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        steps = llm.collective_rpc(
            lambda worker: getattr(worker.model_runner.fused_decode, "steps", None)
        )[0]
    finally:
        llm.shutdown()
    answers = [
        (
            o.outputs[0].token_ids,
            [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs],
        )
        for o in outs
    ]
    return answers, steps


def _same_as_layers(path: pathlib.Path, monkeypatch, **engine: Any) -> None:
    fused, steps = _generate(path, True, monkeypatch, **engine)
    layered, off = _generate(path, False, monkeypatch, **engine)
    assert off is None  # switched off: no fused step was made
    assert steps and steps >= 20, steps  # most of the 24 decode steps ran fused
    assert fused == layered


def _mixed_4_and_8_bits(name: str) -> str:
    return "Q8_0" if "ffn_down" in name or "attn_v" in name else "Q4_1"


def _q4_k_m(name: str) -> str:
    """llama.cpp's Q4_K_M mix: V and the down projection in Q6_K, the rest in Q4_K."""
    return "Q6_K" if ("attn_v" in name or "ffn_down" in name) else "Q4_K"


def test_q4_1_and_q8_0_blocks_decode_fused_as_layer_by_layer(tiny_llama, tmp_path, monkeypatch):
    path = write_gguf(tiny_llama, tmp_path / "mixed.gguf", types=_mixed_4_and_8_bits)
    _same_as_layers(path, monkeypatch)


def test_k_quants_decode_fused_as_layer_by_layer(tiny_llama, tmp_path, monkeypatch):
    """Q4_K beside Q6_K in one fused QKV: the 6-bit part takes the sub-block kernel."""
    path = write_gguf(tiny_llama, tmp_path / "q4_k_m.gguf", types=_q4_k_m)
    _same_as_layers(path, monkeypatch)


def _same_bits_on_any_number_of_threads(
    path: pathlib.Path,
    threads: tuple[int, ...],
    prompts: list[list[int]] = PROMPTS,
    idle_cpu: list[float] | None = None,
) -> None:
    """Each of the first decode steps (one to four rows), run again on each of ``threads``,
    gives the hidden states it gave on the engine's (running it again writes the same K/V
    to the same places). ``idle_cpu`` gets, for the first one-row steps, what the step's
    other threads spend after it while its caller sleeps."""
    from enginecore import LLM, SamplingParams

    runs: list[list[torch.Tensor]] = []
    with LLM(str(path), multiprocessing=False, max_num_batched_tokens=32) as llm:
        step = llm.collective_rpc(lambda w: w.model_runner.fused_decode)[0]
        fused_run = step.run

        def run_on_several(ids: Any, positions: Any, batch: Any, **head: Any) -> torch.Tensor:
            hidden = fused_run(ids, positions, batch, **head)
            if idle_cpu is not None and ids.shape[0] == 1 and len(idle_cpu) < 3:
                idle_cpu.append(idle_cpu_after(fused_run, ids, positions, batch))
            if len(runs) < 6:
                runs.append(
                    [hidden]
                    + [fused_run(ids, positions, batch, threads=t, **head) for t in threads]
                )
            return hidden

        step.run = run_on_several
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        if idle_cpu is not None:  # a single stream: one-row steps
            llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    assert len(runs) == 6 and max(hidden.shape[0] for hidden, *_ in runs) > 1
    for hidden, *again in runs:
        for other in again:
            assert torch.equal(hidden, other)


def test_the_fused_step_gives_the_same_bits_on_any_number_of_threads(tiny_llama, tmp_path):
    """The threads take chunks of rows and attention units as they come: the same hidden
    states on 1, 2, 3 and 5 threads. Q4_K beside Q6_K in one product: chunks of both
    formats. After a step its other threads take no core while the engine's Python runs."""
    path = write_gguf(tiny_llama, tmp_path / "q4_k_m.gguf", types=_q4_k_m)
    idle_cpu: list[float] = []
    _same_bits_on_any_number_of_threads(path, (1, 2, 3, 5), idle_cpu=idle_cpu)
    # Between steps the team's threads spin no longer than at a phase (ECD_SPIN_CYCLES,
    # well under a millisecond), then sleep: they leave the cores to the engine's Python.
    # (test_the_step_threads_sleep_between_steps_in_a_fresh_process: OpenMP's spun on.)
    assert len(idle_cpu) == 3 and min(idle_cpu) < 0.001, idle_cpu


@pytest.mark.slow
def test_the_step_threads_sleep_between_steps_in_a_fresh_process(tiny_llama, tmp_path):
    """In a process whose only OpenMP user is the engine's worker (an engine process),
    OpenMP's idle thread spins for milliseconds after every step, holding a core the
    engine's and the frontend's Python wait for where cores are few; the step's own team
    sleeps once
    ECD_SPIN_CYCLES have passed. (In this test process OpenMP throttles its spinning:
    more threads than cores have used it.)"""
    import subprocess
    import sys

    path = write_gguf(tiny_llama, tmp_path / "q4_k_m.gguf", types=_q4_k_m)
    done = subprocess.run(
        [sys.executable, "-m", "tests.helpers.fused_idle_cpu", str(path)],
        capture_output=True, text=True, timeout=300, cwd=pathlib.Path(__file__).parents[2],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    idle = [float(line) for line in done.stdout.split()]
    assert len(idle) == 3 and min(idle) < 0.001, idle


# Prompts whose decodes attend 1, 2, 4 and 8 spans of positions (ec_attention_spans)
SPAN_PROMPTS = [list(range(3 + i, 3 + i + length)) for i, length in enumerate((20, 90, 150, 520))]


@pytest.mark.slow
def test_attention_spans_decode_fused_as_layer_by_layer_on_any_threads(
    tiny_llama, tmp_path, monkeypatch
):
    """Contexts past one span: each KV head's spans are units the threads share, merged
    by whichever finishes last, as the layers' kernel attends and merges them (the fast
    sibling: test_attention_variants.py's spans against SDPA)."""
    path = write_gguf(tiny_llama, tmp_path / "q4_0.gguf", types=lambda name: "Q4_0")
    fused, steps = _generate(path, True, monkeypatch, SPAN_PROMPTS)
    layered, off = _generate(path, False, monkeypatch, SPAN_PROMPTS)
    assert off is None and steps and steps >= 20, (off, steps)
    assert fused == layered
    monkeypatch.setenv("ENGINECORE_FUSED_DECODE", "1")
    _same_bits_on_any_number_of_threads(path, (1, 2, 3), SPAN_PROMPTS)


def _q5_k_m(name: str) -> str:
    """llama.cpp's Q5_K_M mix: V and the down projection in Q6_K, the rest in Q5_K."""
    return "Q6_K" if ("attn_v" in name or "ffn_down" in name) else "Q5_K"


def test_q5_k_beside_q6_k_decodes_fused_as_layer_by_layer(tiny_llama, tmp_path, monkeypatch):
    """Q and K in Q5_K, V in Q6_K in one fused QKV: two parts of the packed sub-block
    kernel, one for each bit width."""
    path = write_gguf(tiny_llama, tmp_path / "q5_k_m.gguf", types=_q5_k_m)
    _same_as_layers(path, monkeypatch)


def _with_random_biases(checkpoint: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """A copy of a Qwen2 checkpoint whose Q/K/V biases are random, not zero."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, out)
    tensors = load_file(out / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name, tensor in tensors.items():
        if name.endswith("_proj.bias"):
            tensors[name] = torch.randn(tensor.shape, generator=generator).to(tensor.dtype)
    save_file(tensors, out / "model.safetensors")
    return out


def test_qwen2_qkv_bias_decodes_fused_as_layer_by_layer(tiny_qwen2, tmp_path, monkeypatch):
    """Random (not zero) Q/K/V biases: the fused step adds them as the layers do."""
    biased = _with_random_biases(tiny_qwen2, tmp_path / "biased")
    path = write_gguf(biased, tmp_path / "qwen2.gguf", types=lambda name: "Q4_0")
    _same_as_layers(path, monkeypatch)


def test_int8_sliding_window_decodes_fused_as_layer_by_layer(checkpoint_factory, monkeypatch):
    """A float checkpoint quantized to int8 at load, with a window shorter than the
    prompts: the fused step attends over the window as the layers do."""
    path = checkpoint_factory("mistral", sliding_window=16)
    _same_as_layers(path, monkeypatch, quantization="int8")


@pytest.fixture
def one_torch_thread(monkeypatch):
    """torch (and so MKL) on one thread, which the worker then keeps: the layers'
    ``F.linear`` on more threads lets MKL split a product in ways that change its bits
    (as it changes the layers' own from one thread count to another); the fused step's
    products are the one-thread ones whatever its team."""
    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_torch_thread")
def test_float32_weights_decode_fused_as_layer_by_layer(tiny_llama, monkeypatch):
    """Float32 weights (``cpu_packed``, input-major): the step multiplies them with the
    BLAS sgemm ``F.linear`` reaches, so the tokens and log-probabilities are the layers'."""
    _same_as_layers(tiny_llama, monkeypatch)


def test_float32_fused_step_gives_the_same_bits_on_any_number_of_threads(tiny_llama):
    """Each thread's chunk of a float32 product is one sgemm on that thread alone: the
    same hidden states on 1, 2 and 3 threads."""
    _same_bits_on_any_number_of_threads(tiny_llama, (1, 2, 3))


@pytest.mark.usefixtures("one_torch_thread")
def test_float32_row_major_weights_with_bias_decode_fused_as_layer_by_layer(
    tiny_qwen2, tmp_path, monkeypatch
):
    """Row-major float32 weights (the plain linear method) and random Q/K/V biases: the
    same bits, the step adding each bias inside sgemm as ``F.linear``'s addmm does (a
    bias added after the product differs on some CPUs, AMD's among them, from 4 rows)."""
    biased = _with_random_biases(tiny_qwen2, tmp_path / "biased")
    _same_as_layers(biased, monkeypatch, linear_method="unquantized")


def test_float32_steps_of_many_rows_decode_fused_and_greedy_as_transformers(
    tiny_llama, monkeypatch
):
    """Forty requests decoding together (beyond the block formats' row limit): every such
    step runs fused, and each request's greedy tokens are transformers' ``generate``."""
    from enginecore import LLM, SamplingParams
    from tests.helpers.hf_reference import greedy_reference

    monkeypatch.setenv("ENGINECORE_FUSED_DECODE", "1")
    prompts = [[(i * 37 + j) % 200 + 3 for j in range(4 + i % 9)] for i in range(40)]
    with LLM(str(tiny_llama), multiprocessing=False) as llm:
        step = llm.collective_rpc(lambda w: w.model_runner.fused_decode)[0]
        rows: list[int] = []
        fused_run = step.run

        def counted(ids: Any, positions: Any, batch: Any, **head: Any) -> torch.Tensor:
            rows.append(ids.shape[0])
            out: torch.Tensor = fused_run(ids, positions, batch, **head)
            return out

        step.run = counted
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert max(rows) == 40 > decode_step.DIRECT_MAX_ROWS and len(rows) >= 10, rows
    for prompt, out in zip(prompts, outs, strict=True):
        tokens, first_tie = greedy_reference(tiny_llama, prompt, 12)
        assert out.outputs[0].token_ids[:first_tie] == tokens[:first_tie]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_preempted_prefix_cached_batch_decodes_fused_as_layer_by_layer(
    tiny_llama, monkeypatch, async_scheduling: bool
):
    """Sixteen requests through a KV cache too small for them (preemption drops mirror
    rows mid-request), shared prefixes (cache hits), chunked prompts beside decodes, and
    seeded sampling: the same tokens with the fused step as with the layers."""
    from enginecore import LLM, SamplingParams
    from tests.helpers.prompts import mixed_prompts

    prompts = mixed_prompts(4)
    runs = {}
    for fused in (True, False):
        monkeypatch.setenv("ENGINECORE_FUSED_DECODE", "1" if fused else "0")
        with LLM(
            tiny_llama,
            quantization="int8",
            multiprocessing=False,
            async_scheduling=async_scheduling,
            max_num_batched_tokens=32,
            block_size=16,
            prefix_caching=True,
            num_blocks_override=24,
        ) as llm:
            params = [
                SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
                if i % 2
                else SamplingParams(max_tokens=10, temperature=0.8, seed=i, ignore_eos=True)
                for i in range(len(prompts))
            ]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            steps = llm.collective_rpc(
                lambda worker: getattr(worker.model_runner.fused_decode, "steps", None)
            )[0]
            assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "no preemption forced"
            assert any(o.num_cached_tokens > 0 for o in outs), "no prefix-cache hit"
            runs[fused] = ([o.outputs[0].token_ids for o in outs], steps)
    assert runs[True][1] and runs[False][1] is None
    assert runs[True][0] == runs[False][0]


def test_qwen3_qk_norm_decodes_fused_as_layer_by_layer(checkpoint_factory, tmp_path, monkeypatch):
    """Qwen3 norms each query and key head before the rotation."""
    path = write_gguf(checkpoint_factory("qwen3"), tmp_path / "qwen3.gguf", types=lambda n: "Q4_1")
    _same_as_layers(path, monkeypatch)


@pytest.mark.parametrize("level", [1, 2])
def test_the_fused_step_is_made_again_after_sleep(tiny_llama, tmp_path, monkeypatch, level):
    """Sleep frees the KV cache (level 2 the weights too); after the wake-up the step is
    recorded over the new cache and weights, and decodes as before."""
    from enginecore import LLM, SamplingParams

    path = write_gguf(tiny_llama, tmp_path / "q4.gguf", types=lambda name: "Q4_1")
    monkeypatch.setenv("ENGINECORE_FUSED_DECODE", "1")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(str(path), multiprocessing=False) as llm:

        def steps() -> int:
            return llm.collective_rpc(lambda w: w.model_runner.fused_decode.steps)[0]

        before = llm.generate({"prompt_token_ids": PROMPTS[1]}, params)[0].outputs[0].token_ids
        assert steps() == 11
        llm.collective_rpc(lambda w: w.sleep(level))
        assert llm.collective_rpc(lambda w: w.model_runner.fused_decode)[0] is None
        llm.collective_rpc(lambda w: w.wake_up())
        llm.reset_prefix_cache()
        after = llm.generate({"prompt_token_ids": PROMPTS[1]}, params)[0].outputs[0].token_ids
        assert steps() == 11  # a new step, used for every decode
        assert after == before


def _decode_with_many_rows(path: pathlib.Path, prompts: list[list[int]], fused: bool, monkeypatch):
    """Each request's greedy tokens and log-probabilities, the fused steps' count and how
    many of them had as many rows as some weight's crossover, and the layers'
    ``quant_gemm`` calls of ``len(prompts)`` rows."""
    from enginecore import LLM, SamplingParams

    gemm_rows: list[int] = []
    gemm = quant_gemm.QuantGemm.gemm

    def counted_gemm(self, acts, *args, **kwargs):
        gemm_rows.append(acts.q.shape[0])
        return gemm(self, acts, *args, **kwargs)

    monkeypatch.setattr(quant_gemm.QuantGemm, "gemm", counted_gemm)
    monkeypatch.setenv("ENGINECORE_FUSED_DECODE", "1" if fused else "0")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    with LLM(str(path), multiprocessing=False, max_num_batched_tokens=256) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        steps = llm.collective_rpc(
            lambda w: (
                getattr(w.model_runner.fused_decode, "steps", None),
                getattr(w.model_runner.fused_decode, "many_row_steps", None),
            )
        )[0]
    answers = [
        (
            list(o.outputs[0].token_ids),
            [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs],
        )
        for o in outs
    ]
    return answers, steps, gemm_rows.count(len(prompts))


@pytest.mark.skipif(quant_gemm.load() is None, reason="no many-row kernel")
def test_a_decode_batch_from_the_crossover_takes_the_many_row_kernel_fused(
    tiny_llama, tmp_path, monkeypatch
):
    """A decode batch of as many rows as the Q8_0 crossover of this build
    (``GEMM_FROM_ROWS`` with VNNI, ``GEMM_FROM_ROWS_NO_VNNI`` without) runs fused with the
    many-row kernel for its products, as the layers' ``quant_gemm`` computes them: the
    same tokens and log-probabilities bit for bit. The one-row path (the crossover raised
    past the batch) and the many-row one both decode as transformers does on the file."""
    from transformers import AutoModelForCausalLM

    path = write_gguf(tiny_llama, tmp_path / "q8_0.gguf", quantize=True)
    table_name = "GEMM_FROM_ROWS" if quant_gemm.load().vnni else "GEMM_FROM_ROWS_NO_VNNI"
    rows = getattr(gguf_linear_method, table_name)["Q8"]
    prompts = [list(range(3 + 7 * i, 10 + 7 * i)) for i in range(rows)]
    fused, (steps, many_row_steps), _ = _decode_with_many_rows(path, prompts, True, monkeypatch)
    layered, off, gemm_calls = _decode_with_many_rows(path, prompts, False, monkeypatch)
    assert off == (None, None) and gemm_calls >= 11  # the layers took quant_gemm
    assert fused == layered
    assert steps >= 11 and many_row_steps >= 11, (steps, many_row_steps)

    huge = dict.fromkeys(getattr(gguf_linear_method, table_name), 1 << 20)
    monkeypatch.setattr(gguf_linear_method, table_name, huge)
    one_row, (steps, many_row_steps), _ = _decode_with_many_rows(path, prompts, True, monkeypatch)
    assert steps >= 11 and many_row_steps == 0, (steps, many_row_steps)

    # transformers on the file's de-quantized weights, fed each path's tokens: up to the
    # first step whose top two logits are within the activations' 8-bit rounding, each
    # greedy token is its argmax; after it, within that rounding of the argmax.
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    for answers in (fused, one_row):
        for prompt, (got, _) in zip(prompts, answers, strict=True):
            with torch.no_grad():
                logits = ref(torch.tensor([prompt + got])).logits[0, len(prompt) - 1 : -1]
            tol = 0.02 * float(logits.abs().max())
            top2 = logits.topk(2, -1).values
            close = [*(top2[:, 0] - top2[:, 1] <= tol).tolist(), True]
            first_tie = close.index(True)
            want = logits.argmax(-1).tolist()
            assert got[:first_tie] == want[:first_tie], (got, want, first_tie)
            chosen = logits[torch.arange(len(got)), torch.tensor(got)]
            assert (top2[:, 0] - chosen <= tol).all()


# Run in a child process: the ISA is chosen once a process, when the kernels first load.
_AVX2_VNNI_RUN = """
import json, os, sys
from enginecore_cpu import cpu_kernels
cpu_kernels.instruction_set = lambda: "x86-64-v3"
from enginecore import LLM, SamplingParams
from enginecore_cpu import decode_step, quant_gemm
decode_step.build()
path, rows = sys.argv[1], int(sys.argv[2])
result = {"step": decode_step.build(only_path=True).name, "gemm": quant_gemm.build().name}
prompts = [list(range(3 + 7 * i, 10 + 7 * i)) for i in range(rows)]
params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
for fused in ("1", "0"):
    os.environ["ENGINECORE_FUSED_DECODE"] = fused
    with LLM(path, multiprocessing=False, max_num_batched_tokens=256) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        steps = llm.collective_rpc(
            lambda w: getattr(w.model_runner.fused_decode, "many_row_steps", None)
        )[0]
    answers = [
        [o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in d.items())
                                  for d in o.outputs[0].logprobs]]
        for o in outs
    ]
    result[fused] = [answers, steps]
print(json.dumps(result))
"""


@pytest.mark.slow
@pytest.mark.skipif(
    cpu_kernels.instruction_set() not in ("x86-64-v3", "x86-64-v4")
    or "avx_vnni" not in cpu_kernels._cpu_signature().split(),
    reason="needs an x86-64 CPU with AVX-VNNI",
)
def test_the_avx2_build_with_avx_vnni_decodes_fused_as_its_layers(tiny_llama, tmp_path):
    """On an AVX2 CPU with AVX-VNNI (this one's x86-64-v3 builds, where it has AVX-512
    too) the layers' many-row kernel is built with AVX-VNNI: so is the step's own build
    of it, which it takes from the same crossover rows. A decode batch of that many rows
    gives the layers' tokens and log-probabilities bit for bit."""
    import json
    import subprocess
    import sys

    path = write_gguf(tiny_llama, tmp_path / "q8_0.gguf", quantize=True)
    rows = gguf_linear_method.GEMM_FROM_ROWS["Q8"]
    done = subprocess.run(
        [sys.executable, "-c", _AVX2_VNNI_RUN, str(path), str(rows)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "x86-64-v3-avxvnni" in result["gemm"], result["gemm"]
    assert "x86-64-v3-avxvnni" in result["step"], result["step"]
    (fused, many_row_steps), (layered, off) = result["1"], result["0"]
    assert off is None and many_row_steps >= 11, (off, many_row_steps)
    assert fused == layered
