"""Accuracy of the ``gguf`` linear method against the same quantized weights de-quantized
to float32.

For each checkpoint and method: the model's logits over a few prompts (teacher forced:
one forward over each prompt), computed with the projections kept quantized and the
integer kernels that decode steps use, against the de-quantized weights in float32.
Prints the share of positions whose greedy (argmax) token agrees and the largest logit
difference. The demo GGUF is used as the file stores it (Q4_1 layers, a Q8_0 copy of the
tied head), then its de-quantized weights are quantized again to each method; a random
``small`` checkpoint (``enginecore demo-model DIR --random --arch llama --size small``)
is quantized to each method. GGUF's 32-element formats by gguf's reference code, the
K-quants, AWQ and GPTQ (groups of 64, with zero points) by ``enginecore.testing.
quantizers``, int8 by the method itself. A K-quant needs rows of a multiple of 256
inputs: projections with other widths (the demo model's 576) stay in Q8_0 then, as
llama.cpp falls back to another type for them.

    python benchmarks/quant_accuracy.py [--small DIR] [--methods Q4_K,AWQ,...]
        [--prompts 4] [--no-demo]
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from enginecore.checkpoints import find_demo_gguf
from enginecore.layers import LinearBase, use_linear_method
from enginecore.layers.embedding import VocabParallelEmbedding
from enginecore.layers.quantized import QuantizedTensor
from enginecore.layers.torch_attention import TorchAttentionBackend
from enginecore.plugins import make_plugin_manager
from enginecore.testing import quantizers
from enginecore.testing.attention_steps import make_batch, spec_for_model, step_context
from enginecore_cpu import gguf_linear_method
from enginecore_cpu.gguf_linear_method import GGUFLinearMethod
from enginecore_models.group_quant import GroupQuantConfig, iter_group_quantized
from enginecore_models.weight_loader import (
    iter_weights,
    load_hf_config,
    resolve_model_class,
)

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def model_refs() -> dict[str, str]:
    registry = make_plugin_manager(load_entrypoints=False).registry("model")
    return {name: registry.entry(name).ref for name in registry.names()}


METHODS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "AWQ", "GPTQ", "int8")
GROUP = 64
INT8 = SimpleNamespace(model=SimpleNamespace(quantization="int8"))


def build(
    cfg: Any, weights: Iterator[tuple[str, Any]], quantized: bool, config: Any = None
) -> torch.nn.Module:
    method = GGUFLinearMethod(config) if quantized else None
    cls = resolve_model_class(cfg, model_refs())
    if method is None:
        model = cls(cfg)
    else:
        with use_linear_method(method):
            model = cls(cfg)
    model.load_weights(weights)
    if method is not None:
        for layer in model.modules():
            if isinstance(layer, LinearBase):
                layer.linear_method.process_weights_after_loading(layer)
        head = model.logits_head()
        if isinstance(head, VocabParallelEmbedding):
            head.linear_method.process_weights_after_loading(head)
    return model.eval()


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    bs = 16
    blocks = -(-len(ids) // bs)
    backend = TorchAttentionBackend(spec_for_model(model, block_size=bs))
    kv = backend.allocate_kv_cache(blocks + 1)
    ctx = step_context(backend, make_batch([len(ids)], [0], [list(range(blocks))], bs))
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids)), kv, ctx))


def _is_projection(name: str, tensor: torch.Tensor) -> bool:
    return name.endswith(".weight") and any(f".{p}." in name for p in PROJECTIONS)


def _gguf_raw(tensor: torch.Tensor, fmt: str) -> tuple[np.ndarray, str]:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if fmt.endswith("_K"):
        if tensor.shape[1] % quantizers.SUPER == 0:
            return quantizers.quantize_k(tensor, fmt), fmt
        fmt = "Q8_0"  # rows not of whole super-blocks
    return quantize(tensor.float().numpy(), GGMLQuantizationType[fmt]), fmt


def requantized(weights: Iterator[tuple[str, torch.Tensor]], method: str, reference: bool):
    """Projections quantized by ``method``: kept quantized, or (``reference``) as the
    float32 weights they stand for."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if method in ("AWQ", "GPTQ"):
        yield from _group_quantized(weights, method, reference)
        return
    for name, tensor in weights:
        if not _is_projection(name, tensor):
            yield name, tensor
        elif method == "int8":  # the method quantizes float weights itself
            yield name, _int8_reference(tensor) if reference else tensor
        else:
            raw, fmt = _gguf_raw(tensor, method)
            if reference:
                array = np.array(dequantize(raw, GGMLQuantizationType[fmt]), np.float32)
                yield name, torch.from_numpy(array).reshape(tensor.shape)
            else:
                data = torch.from_numpy(np.ascontiguousarray(raw)).reshape(tensor.shape[0], -1)
                yield name, QuantizedTensor(data, fmt, tuple(tensor.shape))


def _int8_reference(tensor: torch.Tensor) -> torch.Tensor:
    scale = tensor.float().abs().amax(1, keepdim=True) / 127
    return torch.round(tensor.float() / torch.where(scale > 0, scale, 1)).clamp(-127, 127) * scale


def _group_quantized(weights, method: str, reference: bool):
    packed = []
    for name, tensor in weights:
        if not _is_projection(name, tensor):
            yield name, tensor
            continue
        q, scales, zeros = quantizers.quantize_groups(tensor, GROUP, symmetric=False)
        if method == "GPTQ":
            zeros = zeros.clamp(min=1)  # GPTQ's format stores zero - 1
        if reference:
            yield name, quantizers.dequantize_groups(q, scales, zeros)
            continue
        layout = quantizers.awq_tensors if method == "AWQ" else quantizers.gptq_tensors
        module = name.removesuffix(".weight")
        packed += [(f"{module}.{leaf}", t) for leaf, t in layout(q, scales, zeros).items()]
    if not reference:
        qc = GroupQuantConfig(method.lower(), GROUP, 1 if method == "GPTQ" else 0)
        yield from iter_group_quantized(iter(packed), qc, blocks=True)


def compare(label: str, reference: torch.nn.Module, quantized: torch.nn.Module, prompts) -> str:
    agree = total = 0
    worst = 0.0
    for ids in prompts:
        want, got = logits(reference, ids), logits(quantized, ids)
        agree += int((want.argmax(-1) == got.argmax(-1)).sum())
        total += len(ids)
        worst = max(worst, (want - got).abs().max().item())
    return f"| {label} | {agree}/{total} ({100 * agree / total:.1f}%) | {worst:.3f} |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", help="a random small llama checkpoint directory")
    parser.add_argument("--methods", default=",".join(METHODS), type=lambda v: v.split(","))
    parser.add_argument("--prompts", type=int, default=4, help="prompts of 64 random tokens")
    parser.add_argument("--no-demo", action="store_true", help="only the --small checkpoint")
    args = parser.parse_args()
    # Every row through integer kernels (the one-row ones, or quant_gemm's for prompts),
    # never the float fallback, as the engine computes them.
    gguf_linear_method.DIRECT_MAX_ROWS = 1 << 30
    gen = torch.Generator().manual_seed(0)
    rows = [
        "| checkpoint / format | greedy agreement | largest logit difference |",
        "|---|---|---|",
    ]

    path = find_demo_gguf()
    cfg = load_hf_config(path)
    prompts = [torch.randint(0, cfg.vocab_size, (64,), generator=gen) for _ in range(args.prompts)]
    if "Q4_1" in args.methods and not args.no_demo:
        reference = build(cfg, iter_weights(path, cfg), quantized=False)
        blocks = build(cfg, iter_weights(path, cfg, GGUFLinearMethod.gguf_formats), True)
        rows.append(compare("demo GGUF as stored, Q4_1 (head Q8_0)", reference, blocks, prompts))
        print(rows[-1], flush=True)
        del reference, blocks
    checkpoints = [] if args.no_demo else [("demo, re-quantized", path, cfg, prompts)]
    if args.small:
        cfg = load_hf_config(args.small)
        prompts = [
            torch.randint(0, cfg.vocab_size, (64,), generator=gen) for _ in range(args.prompts)
        ]
        checkpoints.append(("random small", args.small, cfg, prompts))
    for label, source, cfg, prompts in checkpoints:
        for method in args.methods:
            reference = build(cfg, requantized(iter_weights(source, cfg), method, True), False)
            config = INT8 if method == "int8" else None
            weights = requantized(iter_weights(source, cfg), method, False)
            blocks = build(cfg, weights, True, config)
            rows.append(compare(f"{label}, {method} (head Q8_0)", reference, blocks, prompts))
            print(rows[-1], flush=True)
            del reference, blocks
    print("\n".join(rows))


if __name__ == "__main__":
    main()
