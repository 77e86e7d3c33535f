"""The GPU check: one command, under 8 minutes on one GPU, that says whether the GPU path
is right and how fast it is.

    python benchmarks/gpu_check.py [--out results.json] [--quick]
    python benchmarks/gpu_check.py --cpu-smoke   # every stage on the CPU, small shapes

1. Greedy parity with transformers ``generate`` on random ``tiny`` and ``small`` Llama
   checkpoints, float32 and bfloat16, through the ``triton`` and ``torch`` backends, in one
   mixed batch (prompts of 5 to 300 tokens, chunked prefill and prefix caching on).
2. ``triton`` against ``torch`` on the same batches (token agreement).
3. Throughput, N=256 prompts x 128 in / 128 out, against transformers ``generate``
   (one padded batch) on the same GPU, bfloat16.
4. Decode step time at batch 1, 64 and 256 on a random checkpoint of Llama-3.2-1B's shape
   (1.2 B parameters, bfloat16, 512-token contexts), with CUDA graphs and without
   (``enforce_eager``), against the bound set by the bytes a step reads (weights + the KV
   read) at the GPU's copy bandwidth. The bandwidth counts the bytes a copy reads and writes,
   so the bound is the bytes read over it (``decode_bound_s``). A step's time is the
   engine's, host work included (the wall clock of 64 extra decode steps).
5. The ``gguf_triton`` block kernels (``builtin_gpu/enginecore_gpu/block_kernels.py``, also in
   ``--quick``): Q4_1, Q4_K-style (float32 scales) and Q8_0 blocks of a 4096 x 4096 weight,
   bf16 activations of 1, 16 and 256 rows, against ``F.linear`` on the de-quantized bf16
   weight (the largest difference, relative to the largest output) and timed against it
   with CUDA events: the kernel, and ``F.linear`` on a bf16 weight. Then the ``tiny``
   checkpoint with ``quantization="int8"`` (which selects ``gguf_triton`` on CUDA), bf16,
   CUDA graphs on: the layers kept in blocks and greedy agreement with the float model.
6. A random tiny Mixtral (also in ``--quick``), float32, CUDA graphs on: its experts on the
   capture-safe device path, greedy agreement with transformers, and how many steps
   replayed a graph. The decode stage reports the same counts (steps replayed, and those
   run eager by reason).
7. LoRA (also in ``--quick``): three PEFT adapters of different ranks and targets plus the
   base model in one batch on ``tiny``, float32, through the ``triton`` backend (its
   Triton shrink/expand kernels) and the ``torch`` backend (the torch kernels): greedy
   agreement with transformers + PEFT per adapter, with CUDA graphs on: the decode steps
   replay graphs captured with the dense LoRA kernels (``enginecore.lora.graph_inputs``),
   and the stage fails when none replayed.
8. Piecewise graphs (also in ``--quick``): ``tiny``, float32, ``piecewise_cuda_graphs``
   on and a 64-token budget, through both backends: prompts in chunks beside decoding
   rows replay the pieces captured between the attention ops
   (``builtin_models/enginecore_models/piecewise_graphs.py``), attention eager; greedy
   agreement with transformers, and the stage fails when no step replayed the pieces.

``--cpu-smoke`` runs every stage on the CPU with small shapes (the ``torch`` attention
backend, the kernels under ``TRITON_INTERPRET=1``, a scaled-down copy of the 1B shape), so
the script is known to run before a GPU is at hand; its figures mean nothing.

Prints a Markdown report and writes the figures as JSON. Needs the wheels in
``benchmarks/gpu_requirements.txt`` on top of torch, triton and transformers.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import random
import sys
import tempfile
import time
from typing import Any

import torch

DECODE_CONTEXT = 512
DECODE_STEPS = 64
# Llama-3.2-1B's shape (the vocabulary and rope scaling included), positions capped so the
# KV cache is sized for the check's contexts.
LLAMA_3_2_1B: dict[str, Any] = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": True,
}
# The same structure, small: what --cpu-smoke runs.
SMOKE_SHAPE: dict[str, Any] = {
    **LLAMA_3_2_1B,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 1024,
}


class Setup:
    """What differs between the GPU check and its CPU smoke run."""

    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke
        self.device = "cpu" if smoke else "cuda"
        self.dtype = "float32" if smoke else "bfloat16"
        self.backends = ("torch",) if smoke else ("triton", "torch")
        self.dtypes = (
            (("float32", torch.float32),)
            if smoke
            else (
                ("float32", torch.float32),
                ("bfloat16", torch.bfloat16),
            )
        )
        self.decode_shape = SMOKE_SHAPE if smoke else LLAMA_3_2_1B
        self.decode_batches = [1, 4] if smoke else [1, 64, 256]
        self.decode_context = 32 if smoke else DECODE_CONTEXT
        self.decode_steps = 4 if smoke else DECODE_STEPS
        self.new_tokens = 4 if smoke else 24
        self.prompts = 2 if smoke else 8
        self.block_shape = (128, 256) if smoke else (4096, 4096)
        self.block_rows = (1, 16, 80) if smoke else (1, 16, 256)
        self.reps = 2 if smoke else 50

    def engine_args(self) -> dict[str, Any]:
        if self.smoke:
            return {"device": "cpu", "kv_cache_bytes": 64 << 20}
        return {"gpu_memory_utilization": 0.3}

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def free(self) -> None:
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()


def hf_dtype(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """transformers' dtype argument: ``dtype=`` from 4.56 on, ``torch_dtype=`` before."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) >= Version("4.56"):
        return {"dtype": dtype}
    return {"torch_dtype": dtype}


def make_shaped_checkpoint(
    root: pathlib.Path, name: str, shape: dict[str, Any], device: str
) -> pathlib.Path:
    """A seeded random Llama checkpoint of ``shape`` (bfloat16 weights, built on
    ``device``), with the test tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from enginecore.checkpoints import make_tokenizer

    out = root / name
    tokenizer = make_tokenizer(min(8192, shape["vocab_size"]))
    config = LlamaConfig(
        **shape,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, **hf_dtype(torch.bfloat16))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    del model
    return out


def time_us(fn: Any, device: str, reps: int) -> float:
    """Microseconds a call of ``fn`` takes on ``device``: CUDA events around ``reps`` calls
    after three warm-up calls (the wall clock on a CPU)."""
    for _ in range(3):
        fn()
    if device != "cuda":
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps * 1e6
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / reps * 1e3


def decode_bound_s(weight_bytes: float, kv_read_bytes: float, copy_bandwidth: float) -> float:
    """The least time a decode step can take: the bytes it reads at the copy bandwidth,
    which counts every byte a copy reads and writes (so no halving)."""
    return (weight_bytes + kv_read_bytes) / copy_bandwidth


def make_checkpoint(root: pathlib.Path, size: str) -> pathlib.Path:
    from enginecore.checkpoints import make_random_checkpoint

    return make_random_checkpoint(root / f"llama-{size}", "llama", size)


def mixed_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [5, 17, 64, 300, 33, 128, 7, 250][:n]
    shared = [rng.randrange(3, 8000) for _ in range(48)]  # a common prefix: cache hits
    out = []
    for i, length in enumerate(lengths):
        tail = [rng.randrange(3, 8000) for _ in range(length)]
        out.append(shared + tail if i % 2 else tail)
    return out


def hf_greedy(
    setup: Setup, path: pathlib.Path, prompts: list[list[int]], dtype: torch.dtype, n: int
) -> list:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, **hf_dtype(dtype)).to(setup.device).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:  # one at a time: no padding in the reference
            ids = torch.tensor([p], device=setup.device)
            gen = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
            outs.append(gen[0, len(p) :].tolist())
    del model
    setup.free()
    return outs


def ours_greedy(
    setup: Setup, path: pathlib.Path, prompts: list[list[int]], dtype: str, backend: str, n: int
) -> list:
    from enginecore import LLM, SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    with LLM(
        str(path),
        dtype=dtype,
        attention_backend=backend,
        max_num_batched_tokens=256,  # prompts of 300 tokens are chunked
        multiprocessing=False,
        **setup.engine_args(),
    ) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    setup.free()
    return [o.outputs[0].token_ids for o in outs]


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def parity(setup: Setup, root: pathlib.Path, sizes: list[str], report: dict[str, Any]) -> None:
    prompts = mixed_prompts(setup.prompts)
    n = setup.new_tokens
    for size in sizes:
        path = make_checkpoint(root, size)
        for dtype, tdtype in setup.dtypes:
            want = hf_greedy(setup, path, prompts, tdtype, n)
            got = {b: ours_greedy(setup, path, prompts, dtype, b, n) for b in setup.backends}
            for backend, outs in got.items():
                diffs = [first_difference(o, w) for o, w in zip(outs, want, strict=True)]
                report["parity"].append(
                    {
                        "size": size,
                        "dtype": dtype,
                        "backend": backend,
                        "equal": sum(d is None for d in diffs),
                        "of": len(diffs),
                        "first_difference": diffs,
                    }
                )
            if "triton" in got:
                agree = sum(a == b for a, b in zip(got["triton"], got["torch"], strict=True))
                report["triton_vs_torch"].append(
                    {"size": size, "dtype": dtype, "equal": agree, "of": len(prompts)}
                )


def throughput(setup: Setup, root: pathlib.Path, report: dict[str, Any], num: int) -> None:
    from transformers import AutoModelForCausalLM

    from enginecore import LLM, SamplingParams

    path = make_checkpoint(root, "tiny" if setup.smoke else "small")
    length = 8 if setup.smoke else 128
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 1000) for _ in range(length)] for _ in range(num)]
    params = SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True)
    with LLM(
        str(path), dtype=setup.dtype, max_num_seqs=256, multiprocessing=False, **setup.engine_args()
    ) as llm:
        llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4))
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        ours = time.perf_counter() - start
    setup.free()
    model = AutoModelForCausalLM.from_pretrained(path, **hf_dtype(getattr(torch, setup.dtype)))
    model = model.to(setup.device).eval()
    ids = torch.tensor(prompts, device=setup.device)
    with torch.inference_mode():
        model.generate(ids[:2], max_new_tokens=4, do_sample=False)
        setup.sync()
        start = time.perf_counter()
        model.generate(
            ids,
            max_new_tokens=length,
            min_new_tokens=length,
            do_sample=False,
            attention_mask=torch.ones_like(ids),
        )
        setup.sync()
        hf = time.perf_counter() - start
    del model
    setup.free()
    tokens = num * length
    report["throughput"] = {
        "prompts": num,
        "length": length,
        "ours_tok_s": tokens / ours,
        "transformers_tok_s": tokens / hf,
        "ratio": hf / ours,
    }


def _graph_counts(worker: Any) -> dict[str, int]:
    """Steps that replayed a CUDA graph, and those that ran eager by reason."""
    graphs = worker.model_runner.decode_graphs
    return dict(graphs.counts) if graphs is not None else {}


def _moe_groupings(worker: Any) -> list[str]:
    from enginecore.layers.moe import FusedMoE

    model = worker.model_runner.model
    return sorted({m.grouping for m in model.modules() if isinstance(m, FusedMoE)})


def moe_graphs(setup: Setup, root: pathlib.Path, report: dict[str, Any]) -> None:
    """A random tiny Mixtral, float32, CUDA graphs on: the experts on their device path
    (captured in the graphs), greedy tokens against transformers, steps replayed."""
    from enginecore import LLM, SamplingParams
    from enginecore.checkpoints import make_random_checkpoint

    path = make_random_checkpoint(root / "mixtral-tiny", "mixtral", "tiny")
    prompts = mixed_prompts(setup.prompts)
    n = setup.new_tokens
    want = hf_greedy(setup, path, prompts, torch.float32, n)
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    with LLM(str(path), dtype="float32", multiprocessing=False, **setup.engine_args()) as llm:
        groupings = llm.collective_rpc(_moe_groupings)[0]
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        counts = llm.collective_rpc(_graph_counts)[0]
    setup.free()
    diffs = [first_difference(o.outputs[0].token_ids, w) for o, w in zip(got, want, strict=True)]
    report["moe"] = {
        "groupings": groupings,
        "equal": sum(d is None for d in diffs),
        "of": len(diffs),
        "first_difference": diffs,
        "graph_steps": counts,
    }


def _weight_bytes(worker: Any) -> int:
    model = worker.model_runner.model
    return sum(p.numel() * p.element_size() for p in model.parameters())


def copy_bandwidth(device: str, numel: int = 1 << 28) -> float:
    """Bytes per second a device-to-device copy moves (its reads and writes both counted),
    timed with CUDA events on a GPU."""
    src = torch.empty(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), device, 10)
    return 2 * src.numel() * src.element_size() / (us * 1e-6)


def decode_steps(setup: Setup, root: pathlib.Path, report: dict[str, Any]) -> None:
    from enginecore import LLM, SamplingParams

    path = make_shaped_checkpoint(root, "llama-1b-shape", setup.decode_shape, setup.device)
    bandwidth = copy_bandwidth(setup.device, 1 << 20 if setup.smoke else 1 << 28)
    batches, context, steps_timed = setup.decode_batches, setup.decode_context, setup.decode_steps
    rng = random.Random(2)
    rows = []
    parameters = 0
    graph_steps: dict[str, int] = {}
    for eager in (False, True):
        with LLM(
            str(path),
            dtype=setup.dtype,
            max_num_seqs=max(batches),
            enforce_eager=eager,
            block_size=16,
            multiprocessing=False,
            **setup.engine_args(),
        ) as llm:
            weight_bytes = llm.collective_rpc(_weight_bytes)[0]
            parameters = (
                weight_bytes // torch.tensor([], dtype=getattr(torch, setup.dtype)).element_size()
            )
            block_bytes = llm.collective_rpc("get_kv_cache_block_bytes")[0]
            for batch in batches:
                prompts = [
                    {"prompt_token_ids": [rng.randrange(3, 1000) for _ in range(context)]}
                    for _ in range(batch)
                ]
                times = {}
                for steps in (1, steps_timed + 1):
                    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
                    llm.reset_prefix_cache()
                    start = time.perf_counter()
                    llm.generate(prompts, params)
                    times[steps] = time.perf_counter() - start
                step = (times[steps_timed + 1] - times[1]) / steps_timed
                kv_read = batch * (context + steps_timed / 2) * block_bytes / 16
                bound = decode_bound_s(weight_bytes, kv_read, bandwidth)
                rows.append(
                    {
                        "batch": batch,
                        "cuda_graphs": not eager,
                        "step_ms": step * 1e3,
                        "bound_ms": bound * 1e3,
                        "of_bound": bound / step if step > 0 else None,
                    }
                )
            if not eager:
                graph_steps = llm.collective_rpc(_graph_counts)[0]
        setup.free()
    report["decode"] = {
        "parameters": parameters,
        "context": context,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "rows": rows,
        "graph_steps": graph_steps,
    }


def random_blocks(kind: str, n: int, k: int, device: str) -> Any:
    """A random weight [n, k] in the ``gguf_triton`` method's block layout."""
    from enginecore.block_formats.gguf_blocks import BlockWeight

    gen = torch.Generator(device=device).manual_seed(0)
    blocks = (n, k // 32)
    if kind == "Q8_0":
        qs = torch.randint(-127, 128, (n, k), generator=gen, device=device, dtype=torch.int8)
        d = torch.rand(blocks, generator=gen, device=device) / 127
        return BlockWeight(8, qs, d, torch.zeros_like(d), (n, k))
    scale_dtype = torch.float16 if kind == "Q4_1" else torch.float32
    qs = torch.randint(0, 256, (n, k // 32, 16), generator=gen, device=device, dtype=torch.uint8)
    d = (torch.rand(blocks, generator=gen, device=device) / 15).to(scale_dtype)
    m = (-8 * d.float()).to(scale_dtype)
    return BlockWeight(4, qs, d, m, (n, k))


def block_linear(setup: Setup, report: dict[str, Any]) -> None:
    import torch.nn.functional as F

    from enginecore_gpu import block_kernels
    from enginecore_gpu.block_linear_method import blocks_linear

    device, reps, row_counts = setup.device, setup.reps, setup.block_rows
    n, k = shape = setup.block_shape
    rows_out = []
    for kind in ("Q4_1", "Q4_K", "Q8_0"):
        part = random_blocks(kind, n, k, device)
        half = block_kernels.dequantize(part.bits, part.qs, part.d, part.m, torch.bfloat16)
        for rows in row_counts:
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            got = block_kernels.block_linear(x, part.bits, part.qs, part.d, part.m)
            want = F.linear(x.float(), half.float())
            err = ((got.float() - want).abs().max() / want.abs().max()).item()
            rows_out.append(
                {
                    "format": kind,
                    "rows": rows,
                    "max_rel_diff": err,
                    "kernel_us": time_us(
                        lambda x=x, p=part: block_kernels.block_linear(x, p.bits, p.qs, p.d, p.m),
                        device,
                        reps,
                    ),
                    "method_us": time_us(
                        lambda x=x, p=part: blocks_linear([(0, p)], x), device, reps
                    ),
                    "f_linear_us": time_us(lambda x=x, w=half: F.linear(x, w), device, reps),
                    "block_mb": part.nbytes / 1e6,
                }
            )
    report["block_linear"] = {
        "shape": list(shape),
        "clock": "CUDA events" if device == "cuda" else "wall",
        "rows": rows_out,
    }


def _block_layers(worker: Any) -> list[str]:
    model = worker.model_runner.model
    return [type(m.linear_method).__name__ for m in model.modules() if hasattr(m, "gguf_blocks")]


def int8_model(setup: Setup, root: pathlib.Path, report: dict[str, Any]) -> None:
    from enginecore import LLM, SamplingParams

    path = make_checkpoint(root, "tiny")
    prompts = mixed_prompts(setup.prompts)
    params = SamplingParams(max_tokens=setup.new_tokens, temperature=0.0, ignore_eos=True)
    # On the CPU gguf_triton runs under Triton's interpreter only when named.
    method = {"linear_method": "gguf_triton"} if setup.smoke else {}
    outs, methods = {}, []
    for quantization in ("int8", "none"):
        with LLM(
            str(path),
            dtype=setup.dtype,
            quantization=quantization,
            multiprocessing=False,
            **(method if quantization == "int8" else {}),
            **setup.engine_args(),
        ) as llm:
            if quantization == "int8":
                methods = llm.collective_rpc(_block_layers)[0]
            got = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            outs[quantization] = [o.outputs[0].token_ids for o in got]
        setup.free()
    diffs = [first_difference(a, b) for a, b in zip(outs["int8"], outs["none"], strict=True)]
    report["int8_model"] = {
        "layers_in_blocks": len(methods),
        "methods": sorted(set(methods)),
        "equal": sum(d is None for d in diffs),
        "of": len(diffs),
        "first_difference": diffs,
    }


def lora(setup: Setup, root: pathlib.Path, report: dict[str, Any]) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from enginecore import LLM, SamplingParams
    from enginecore.lora import LoRARequest
    from enginecore.lora.random_adapter import make_random_adapter
    from enginecore_models.cuda_graphs import REPLAYED

    path = make_checkpoint(root, "tiny")
    shapes = [(8, ("q_proj", "v_proj")), (16, ("q_proj", "k_proj", "o_proj", "up_proj")),
              (4, ("gate_proj", "down_proj"))]  # fmt: skip
    loras: list[LoRARequest | None] = [None]
    for i, (r, targets) in enumerate(shapes):
        adapter = make_random_adapter(path, root / f"lora{i}", r=r, target_modules=targets, seed=i)
        loras.append(LoRARequest(f"lora{i}", i + 1, str(adapter)))
    prompts = mixed_prompts(max(setup.prompts, len(loras)))
    per_prompt = [loras[i % len(loras)] for i in range(len(prompts))]
    n = setup.new_tokens
    want = []
    for prompt, lora_request in zip(prompts, per_prompt, strict=True):
        model = AutoModelForCausalLM.from_pretrained(path, **hf_dtype(torch.float32))
        if lora_request is not None:
            model = PeftModel.from_pretrained(model, lora_request.lora_path)
        with torch.inference_mode():
            ids = torch.tensor([prompt], device=setup.device)
            model = model.to(setup.device).eval()
            out = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
        want.append(out[0, len(prompt) :].tolist())
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    report["lora"] = []
    for backend in setup.backends:
        with LLM(
            str(path), dtype="float32", attention_backend=backend, enable_lora=True,
            max_loras=3, max_lora_rank=16, max_num_batched_tokens=256,
            multiprocessing=False, **setup.engine_args(),
        ) as llm:  # fmt: skip
            got = llm.generate(
                [{"prompt_token_ids": p} for p in prompts], params, lora_request=per_prompt
            )
            counts = llm.collective_rpc(_graph_counts)[0]
        if not setup.smoke and not counts.get(REPLAYED):
            raise RuntimeError(f"LoRA ({backend}): no decode step replayed a CUDA graph: {counts}")
        diffs = [
            first_difference(o.outputs[0].token_ids, w) for o, w in zip(got, want, strict=True)
        ]
        report["lora"].append(
            {"backend": backend, "equal": sum(d is None for d in diffs), "of": len(diffs),
             "first_difference": diffs, "graph_steps": counts}
        )  # fmt: skip
        gc.collect()
        if not setup.smoke:
            torch.cuda.empty_cache()


def _piecewise_counts(worker: Any) -> dict[str, int]:
    """Multi-token steps that replayed piecewise graphs, and those run eager by reason."""
    pieces = worker.model_runner.piecewise_graphs
    return dict(pieces.counts) if pieces is not None else {}


def piecewise(setup: Setup, root: pathlib.Path, report: dict[str, Any]) -> None:
    """``tiny``, float32, ``piecewise_cuda_graphs`` on, a 64-token budget: prompts in
    chunks beside decoding rows replay the pieces between their attention ops. Greedy
    tokens against transformers; fails when no step replayed the pieces."""
    from enginecore import LLM, SamplingParams
    from enginecore_models.piecewise_graphs import PIECEWISE

    path = make_checkpoint(root, "tiny")
    prompts = mixed_prompts(setup.prompts)
    n = setup.new_tokens
    want = hf_greedy(setup, path, prompts, torch.float32, n)
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    report["piecewise"] = []
    for backend in setup.backends:
        with LLM(
            str(path), dtype="float32", attention_backend=backend, piecewise_cuda_graphs=True,
            max_num_batched_tokens=64, multiprocessing=False, **setup.engine_args(),
        ) as llm:  # fmt: skip
            got = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            counts = llm.collective_rpc(_piecewise_counts)[0]
        setup.free()
        if not setup.smoke and not counts.get(PIECEWISE):
            raise RuntimeError(f"piecewise ({backend}): no step replayed the pieces: {counts}")
        diffs = [
            first_difference(o.outputs[0].token_ids, w) for o, w in zip(got, want, strict=True)
        ]
        report["piecewise"].append(
            {"backend": backend, "equal": sum(d is None for d in diffs), "of": len(diffs),
             "first_difference": diffs, "steps": counts}
        )  # fmt: skip


def markdown(report: dict[str, Any]) -> str:
    lines = [f"GPU: {report['gpu']}; torch {report['torch']}", ""]
    lines += ["| size | dtype | backend | greedy = transformers |", "|---|---|---|---|"]
    for r in report["parity"]:
        lines.append(f"| {r['size']} | {r['dtype']} | {r['backend']} | {r['equal']}/{r['of']} |")
    lines += ["", "| size | dtype | triton = torch |", "|---|---|---|"]
    for r in report["triton_vs_torch"]:
        lines.append(f"| {r['size']} | {r['dtype']} | {r['equal']}/{r['of']} |")
    if "throughput" in report:
        t = report["throughput"]
        lines += [
            "",
            f"Throughput, {t['prompts']} x {t['length']}/{t['length']}: ours "
            f"{t['ours_tok_s']:.0f} tok/s, transformers {t['transformers_tok_s']:.0f} tok/s, "
            f"{t['ratio']:.2f}x",
        ]
    if "decode" in report:
        d = report["decode"]
        lines += [
            "",
            f"Decode steps (Llama-3.2-1B shape, {d['parameters'] / 1e9:.2f} B parameters, "
            f"{d['context']}-token contexts); copy bandwidth (read + write) "
            f"{d['copy_bandwidth_gb_s']:.0f} GB/s; bound = bytes read / bandwidth",
            "",
            "| batch | CUDA graphs | step ms | bound ms | bound / step |",
            "|---:|---|---:|---:|---:|",
        ]
        for r in d["rows"]:
            share = f"{r['of_bound']:.2f}" if r["of_bound"] else "-"
            lines.append(
                f"| {r['batch']} | {'on' if r['cuda_graphs'] else 'off'} | "
                f"{r['step_ms']:.2f} | {r['bound_ms']:.3f} | {share} |"
            )
    if "decode" in report:
        lines += ["", f"Steps with CUDA graphs on: {report['decode']['graph_steps'] or 'none'}"]
    if "moe" in report:
        m = report["moe"]
        lines += [
            "",
            f"tiny Mixtral, fp32 (experts grouped: {m['groupings']}): greedy = transformers on "
            f"{m['equal']}/{m['of']} prompts, first differences {m['first_difference']}; "
            f"steps: {m['graph_steps'] or 'no CUDA graphs'}",
        ]
    if "block_linear" in report:
        b = report["block_linear"]
        n, k = b["shape"]
        lines += [
            "",
            f"gguf_triton block kernels, {n} x {k} weight, bf16 activations (µs a call, "
            f"{b['clock']}):",
            "",
            "| format | rows | max rel. diff | kernel | method | F.linear (bf16 weight) |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in b["rows"]:
            lines.append(
                f"| {r['format']} | {r['rows']} | {r['max_rel_diff']:.1e} | "
                f"{r['kernel_us']:.1f} | {r['method_us']:.1f} | {r['f_linear_us']:.1f} |"
            )
    if "int8_model" in report:
        m = report["int8_model"]
        lines += [
            "",
            f"tiny, int8 on CUDA: {m['layers_in_blocks']} layers in blocks ({m['methods']}); "
            f"greedy = bf16 model on {m['equal']}/{m['of']} prompts, first differences "
            f"{m['first_difference']}",
        ]
    for r in report.get("lora", []):
        lines.append(
            f"LoRA (tiny, fp32, 3 adapters + base, {r['backend']}): greedy = transformers + "
            f"PEFT on {r['equal']}/{r['of']} prompts, first differences {r['first_difference']}; "
            f"steps {r['graph_steps']}"
        )
    for r in report.get("piecewise", []):
        lines.append(
            f"Piecewise graphs (tiny, fp32, chunked prefill, {r['backend']}): greedy = "
            f"transformers on {r['equal']}/{r['of']} prompts, first differences "
            f"{r['first_difference']}; steps {r['steps']}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument(
        "--quick", action="store_true", help="tiny parity, the block kernels and int8 on tiny only"
    )
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="every stage on the CPU with small shapes: checks that the script runs",
    )
    args = parser.parse_args()
    if args.cpu_smoke:
        # Before the kernels' modules are imported: their kernels run in the interpreter.
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print("no CUDA device: the GPU check needs one (or try --cpu-smoke)", file=sys.stderr)
        return 2
    setup = Setup(args.cpu_smoke)
    report: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if not setup.smoke else "none (--cpu-smoke)",
        "torch": torch.__version__,
        "parity": [],
        "triton_vs_torch": [],
        "seconds": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        sizes = ["tiny"] if args.quick or setup.smoke else ["tiny", "small"]
        stages = [
            ("parity", lambda: parity(setup, root, sizes, report)),
            ("block_linear", lambda: block_linear(setup, report)),
            ("int8_model", lambda: int8_model(setup, root, report)),
            ("moe", lambda: moe_graphs(setup, root, report)),
            ("lora", lambda: lora(setup, root, report)),
            ("piecewise", lambda: piecewise(setup, root, report)),
        ]
        if not args.quick:
            stages += [
                ("throughput", lambda: throughput(setup, root, report, 4 if setup.smoke else 256)),
                ("decode", lambda: decode_steps(setup, root, report)),
            ]
        for name, stage in stages:
            start = time.perf_counter()
            try:
                stage()
            except Exception as exc:  # report what failed and go on to the next stage
                report.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
            report["seconds"][name] = round(time.perf_counter() - start, 1)
    pathlib.Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    for name, error in report.get("errors", {}).items():
        print(f"\n{name} failed: {error}", file=sys.stderr)
    return 1 if report.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
