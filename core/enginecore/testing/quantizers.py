"""Quantizers that write weights in checkpoint layouts, for tests and benchmarks to make
quantized checkpoints offline: GGUF's K-quants (the ``gguf`` package de-quantizes them
but cannot quantize them) and AWQ / GPTQ 4-bit tensors. Plain round-to-nearest with
min/max scales: their accuracy is not the point, the layouts are.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import torch

SUPER = 256


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _pack_scales_mins(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins [n, 8] as ggml's 12 bytes [n, 12]."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return out


def _asymmetric_k(
    x: np.ndarray, levels: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Super-blocks [n, 256] -> (d, dmin float16 [n], 6-bit sc, mn [n, 8], q [n, 8, 32])."""
    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - low) / levels
    d = _f16(scale.max(-1) / 63)
    dmin = _f16(-low.min(-1) / 63)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.ceil(scale / np.where(df > 0, df, 1)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(-low / np.where(dminf > 0, dminf, 1)), 0, 63).astype(np.uint8)
    step = (df * sc)[..., None]
    q = np.round((sub + (dminf * mn)[..., None]) / np.where(step > 0, step, 1))
    return d, dmin, sc, mn, np.clip(q, 0, levels).astype(np.uint8)


def quantize_k(weight: torch.Tensor, fmt: str) -> np.ndarray:
    """``weight`` [out, in] (in a multiple of 256) as GGUF ``fmt`` (Q4_K, Q5_K, Q6_K)
    super-blocks: uint8 [out, bytes per row]."""
    out = weight.shape[0]
    x = weight.detach().float().numpy().reshape(-1, SUPER)
    n = x.shape[0]
    if fmt == "Q6_K":
        sub = x.reshape(n, 16, 16)
        scale = np.abs(sub).max(-1) / 31
        d = _f16(scale.max(-1) / 127)
        df = d.astype(np.float32)[:, None]
        sc = np.clip(np.ceil(scale / np.where(df > 0, df, 1)), 0, 127).astype(np.int8)
        step = (df * sc)[..., None]
        q = np.clip(np.round(sub / np.where(step != 0, step, 1)), -32, 31).astype(np.int16) + 32
        q = q.reshape(n, 2, 4, 32).astype(np.uint8)  # half, quarter, value
        low = q & 15
        ql = np.concatenate(
            [low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], -1
        )
        qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
        qh = qh | ((q[:, :, 3] >> 4) << 6)
        parts = [
            ql.reshape(n, 128),
            qh.reshape(n, 64),
            sc.view(np.uint8),
            d.reshape(n, 1).view(np.uint8),
        ]
    else:
        levels = 15 if fmt == "Q4_K" else 31
        d, dmin, sc, mn, q = _asymmetric_k(x, levels)
        low = (q & 15).reshape(n, 4, 2, 32)
        qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
        head = [d.reshape(n, 1).view(np.uint8), dmin.reshape(n, 1).view(np.uint8)]
        parts = [*head, _pack_scales_mins(sc, mn)]
        if fmt == "Q5_K":
            bits = (q >> 4).astype(np.uint8)  # [n, 8 sub-blocks, 32]
            qh = np.zeros((n, 32), np.uint8)
            for i in range(8):
                qh |= bits[:, i] << i
            parts.append(qh)
        parts.append(qs)
    return np.concatenate(parts, axis=-1).reshape(out, -1)


# --- AWQ / GPTQ ---------------------------------------------------------------------

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a packed int32 holds column AWQ_ORDER[i]


def quantize_groups(
    weight: torch.Tensor, group: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit round-to-nearest per group of ``group`` inputs: (q [in, out] int 0..15,
    scales [in/group, out] float16, zeros [in/group, out] int; 8 when ``symmetric``).
    The weight stands for (q - zero) scale."""
    out, k = weight.shape
    w = weight.detach().float().t().reshape(k // group, group, out)
    if symmetric:
        scale = w.abs().amax(1) / 7
        zero = torch.full_like(scale, 8)
    else:
        low, high = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
        scale = (high - low) / 15
        zero = torch.round(-low / torch.where(scale > 0, scale, 1)).clamp(0, 15)
    scale = scale.half().float()
    q = torch.round(w / torch.where(scale > 0, scale, 1).unsqueeze(1)) + zero.unsqueeze(1)
    q = q.clamp(0, 15).reshape(k, out).to(torch.int32)
    return q, scale.half(), zero.to(torch.int32)


def dequantize_groups(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The float32 weight [out, in] of :func:`quantize_groups`' output."""
    k = q.shape[0]
    group = k // scales.shape[0]
    s = scales.float().repeat_interleave(group, 0)
    z = zeros.float().repeat_interleave(group, 0)
    return ((q.float() - z) * s).t().contiguous()


def _pack_columns(values: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """[rows, cols] nibbles -> [rows, cols/8] int32, nibble i holding column 8c + order[i]."""
    rows, cols = values.shape
    v = values.reshape(rows, cols // 8, 8).to(torch.int64)
    packed = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for i, column in enumerate(order):
        packed |= (v[..., column] & 15) << (4 * i)
    return _as_int32(packed)


def _as_int32(packed: torch.Tensor) -> torch.Tensor:
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


def awq_tensors(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM layout: ``qweight`` [in, out/8] and ``qzeros`` [in/group, out/8]
    packed along the outputs in AWQ's interleaved order, ``scales`` [in/group, out]."""
    return {
        "qweight": _pack_columns(q, AWQ_ORDER),
        "qzeros": _pack_columns(zeros, AWQ_ORDER),
        "scales": scales,
    }


def gptq_tensors(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, zero_offset: int = 1
) -> dict[str, torch.Tensor]:
    """AutoGPTQ's layout: ``qweight`` [in/8, out] packed along the inputs (nibble i:
    input 8r + i), ``qzeros`` [in/group, out/8] packed along the outputs in order and
    stored minus ``zero_offset`` (1 in the original format, 0 in ``gptq_v2``),
    ``scales`` [in/group, out], ``g_idx`` [in] (the group of each input)."""
    k = q.shape[0]
    group = k // scales.shape[0]
    qweight = _pack_columns(q.t().contiguous(), tuple(range(8))).t().contiguous()
    return {
        "qweight": qweight,
        "qzeros": _pack_columns((zeros - zero_offset) & 15, tuple(range(8))),
        "scales": scales,
        "g_idx": torch.arange(k, dtype=torch.int32) // group,
    }


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_group_quantized(
    source: Path,
    quantized: Path,
    dequantized: Path,
    method: str,
    group: int = 64,
    symmetric: bool = False,
    desc_act: bool = False,
) -> None:
    """From float checkpoint ``source``: an AWQ or GPTQ (``method``) 4-bit checkpoint of
    its projections in ``quantized``, and in ``dequantized`` the float32 checkpoint of
    the weights it stands for (the reference). Other tensors are copied."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(source / "model.safetensors"))
    packed: dict[str, torch.Tensor] = {}
    floats: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rpartition(".")[2] in PROJECTIONS:
            q, scales, zeros = quantize_groups(tensor, group, symmetric)
            if method == "awq":
                parts = awq_tensors(q, scales, zeros)
            else:
                zeros = zeros.clamp(min=1)  # GPTQ's format stores zero - 1
                parts = gptq_tensors(q, scales, zeros)
            packed.update({f"{module}.{leaf}": t for leaf, t in parts.items()})
            floats[name] = dequantize_groups(q, scales, zeros)
        else:
            packed[name] = floats[name] = tensor.float().contiguous()
    config = json.loads((source / "config.json").read_text())
    for target, tensors in ((quantized, packed), (dequantized, floats)):
        target.mkdir(parents=True, exist_ok=True)
        for f in source.iterdir():
            if f.name not in ("model.safetensors", "config.json"):
                shutil.copy(f, target / f.name)
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, str(target / "model.safetensors")
        )
    settings: dict[str, object] = {"quant_method": method, "bits": 4, "group_size": group}
    if method == "awq":
        settings.update(zero_point=True, version="gemm")
    else:
        settings.update(sym=symmetric, desc_act=desc_act, checkpoint_format="gptq")
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": settings}))
    (dequantized / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))


def q5_k_m_type(name: str, layers: int, tied: bool) -> str:
    """The GGUF type llama.cpp's ``Q5_K_M`` gives the 2-D tensor ``name`` of a Llama-shaped
    model of ``layers`` layers: Q6_K for the output head (the token embedding where the
    model ``tied`` them, a file without ``output.weight``) and for V and the down
    projection in its "more bits" layers (the first and last eighth, and every third
    between), Q5_K for the rest."""
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return "Q6_K"
    match = re.match(r"blk\.(\d+)\.(attn_v|ffn_down)\.weight$", name)
    if match is None:
        return "Q5_K"
    i = int(match.group(1))
    more_bits = i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2
    return "Q6_K" if more_bits else "Q5_K"
