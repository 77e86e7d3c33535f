"""Accuracy of the ``gguf`` linear method against the same blocks de-quantized to float32.

For each checkpoint and block format: the model's logits over a few prompts (teacher
forced: one forward over each prompt), computed with the projections in blocks and the
integer kernels that decode steps use, against the de-quantized weights in float32.
Prints the share of positions whose greedy (argmax) token agrees and the largest logit
difference. The demo GGUF is used as the file stores it (Q4_1 layers, a Q8_0 copy of the
tied head); a random ``small`` checkpoint (``enginecore demo-model DIR --random --arch
llama --size small``) is quantized here to each format by gguf's reference code.

    python benchmarks/quant_accuracy.py [--small DIR]
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from enginecore.builtin_attention.torch_backend import TorchAttentionBackend
from enginecore.builtin_cpu import gguf_linear_method
from enginecore.builtin_cpu.gguf_linear_method import GGUFLinearMethod
from enginecore.builtin_models.weight_loader import (
    iter_weights,
    load_hf_config,
    resolve_model_class,
)
from enginecore.checkpoints import find_demo_gguf
from enginecore.layers import LinearBase, use_linear_method
from enginecore.layers.embedding import VocabParallelEmbedding
from enginecore.layers.quantized import QuantizedTensor
from enginecore.plugins import make_plugin_manager
from enginecore.testing.attention_steps import make_batch, spec_for_model, step_context

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def model_refs() -> dict[str, str]:
    registry = make_plugin_manager(load_entrypoints=False).registry("model")
    return {name: registry.entry(name).ref for name in registry.names()}


def build(cfg: Any, weights: Iterator[tuple[str, Any]], quantized: bool) -> torch.nn.Module:
    method = GGUFLinearMethod(None) if quantized else None
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


def requantized(weights: Iterator[tuple[str, torch.Tensor]], fmt: str, reference: bool):
    """Projections quantized to ``fmt``: as blocks, or (``reference``) de-quantized."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[fmt]
    for name, tensor in weights:
        if name.endswith(".weight") and any(f".{p}." in name for p in PROJECTIONS):
            raw = quantize(tensor.float().numpy(), qtype)
            if reference:
                array = np.array(dequantize(raw, qtype), np.float32)
                yield name, torch.from_numpy(array).reshape(tensor.shape)
            else:
                data = torch.from_numpy(np.ascontiguousarray(raw)).reshape(tensor.shape[0], -1)
                yield name, QuantizedTensor(data, fmt, tuple(tensor.shape))
        else:
            yield name, tensor


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
    args = parser.parse_args()
    # Every row through the integer kernels, as a decode step computes it.
    gguf_linear_method.DIRECT_MAX_ROWS = 1 << 30
    gen = torch.Generator().manual_seed(0)
    rows = [
        "| checkpoint / format | greedy agreement | largest logit difference |",
        "|---|---|---|",
    ]

    path = find_demo_gguf()
    cfg = load_hf_config(path)
    prompts = [torch.randint(0, cfg.vocab_size, (64,), generator=gen) for _ in range(4)]
    reference = build(cfg, iter_weights(path, cfg), quantized=False)
    blocks = build(cfg, iter_weights(path, cfg, GGUFLinearMethod.gguf_formats), quantized=True)
    rows.append(compare("demo GGUF, Q4_1 (head Q8_0)", reference, blocks, prompts))
    print(rows[-1], flush=True)
    del reference, blocks

    if args.small:
        cfg = load_hf_config(args.small)
        prompts = [torch.randint(0, cfg.vocab_size, (64,), generator=gen) for _ in range(4)]
        for fmt in ("Q8_0", "Q4_0", "Q4_1"):
            ref_weights = requantized(iter_weights(args.small, cfg), fmt, True)
            reference = build(cfg, ref_weights, quantized=False)
            blocks = build(cfg, requantized(iter_weights(args.small, cfg), fmt, False), True)
            rows.append(compare(f"random small, {fmt} (head Q8_0)", reference, blocks, prompts))
            print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
