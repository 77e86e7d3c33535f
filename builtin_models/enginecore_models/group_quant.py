"""AWQ and GPTQ 4-bit checkpoints: their packed tensors read into 4-bit blocks of 32.

A group-wise 4-bit weight stands for (q - z) s with a scale s and zero point z per group
of G inputs and output column. With G a multiple of 32 each group is G/32 blocks of 32
with d = s and m = -s z: the ``gguf`` linear method's 4-bit blocks (as GGUF's Q4_1),
with no rounding. Where that method does not run (GPU, ``quantization: none``) the
weights are de-quantized here, in torch.

Layouts, as AutoAWQ and AutoGPTQ write them (and vLLM reads them):
- AWQ (``version: gemm``): ``qweight`` [in, out/8] and ``qzeros`` [in/G, out/8] int32
  packed along the outputs, nibble i of a word holding column 8c + (0, 2, 4, 6, 1, 3, 5,
  7)[i]; ``scales`` [in/G, out] float16.
- GPTQ: ``qweight`` [in/8, out] packed along the inputs (nibble i: input 8r + i),
  ``qzeros`` [in/G, out/8] packed along the outputs in order, stored minus one in the
  original format (``checkpoint_format: gptq``) and as they are in ``gptq_v2``;
  ``scales`` [in/G, out]; ``g_idx`` [in], each input's group. ``desc_act`` checkpoints
  load where ``g_idx`` still puts input i in group i // G; a true reordering is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from enginecore.errors import UnsupportedModelError
from enginecore.layers.quantized import QuantizedTensor, int4_blocks

BLOCK = 32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_PARTS = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class GroupQuantConfig:
    method: str  # "awq" or "gptq"
    group_size: int  # -1: one group per column
    zero_offset: int  # added to the stored zero points


def _as_dict(qc: Any) -> dict[str, Any]:
    if isinstance(qc, dict):
        return qc
    return qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))


def group_quant_config(hf_config: Any) -> GroupQuantConfig | None:
    """The checkpoint's AWQ / GPTQ settings; None for any other checkpoint. Raises
    :class:`UnsupportedModelError` for settings that do not load."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = _as_dict(qc)
    method = str(qc.get("quant_method", "")).lower()
    if method not in ("awq", "gptq"):
        return None

    def refuse(what: str) -> UnsupportedModelError:
        return UnsupportedModelError(
            f"{method.upper()} checkpoint with {what} (config.json quantization_config); "
            "enginecore loads 4-bit group-wise AWQ (version gemm, with zero points) and "
            "GPTQ checkpoints with groups of a multiple of 32 inputs"
        )

    bits = int(qc.get("bits", qc.get("w_bit", 0)) or 0)
    if bits != 4:
        raise refuse(f"bits={bits}")
    group = int(qc.get("group_size", qc.get("q_group_size", -1)))
    if group != -1 and (group <= 0 or group % BLOCK):
        raise refuse(f"group_size={group}")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise refuse(f"version={version!r} (its packing differs)")
        if not qc.get("zero_point", True):
            raise refuse("zero_point=false")
        return GroupQuantConfig("awq", group, 0)
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise refuse(f"checkpoint_format={fmt!r}")
    return GroupQuantConfig("gptq", group, 1 if fmt == "gptq" else 0)


def _unpack(packed: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """[rows, cols] int32 words -> [rows, cols * 8] nibbles, nibble i of word c at
    column 8c + order[i]."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    rows, cols = words.shape
    out = torch.empty(rows, cols, 8, dtype=torch.int64)
    for i, column in enumerate(order):
        out[..., column] = (words >> (4 * i)) & 15
    return out.reshape(rows, cols * 8)


def _values(
    name: str, parts: dict[str, torch.Tensor], qc: GroupQuantConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [out, in], scales [out, groups], zeros [out, groups]) of one weight."""
    for needed in ("qweight", "qzeros", "scales"):
        if needed not in parts:
            raise UnsupportedModelError(f"{qc.method.upper()} weight {name} has no {needed}")
    scales = parts["scales"].float()
    if qc.method == "awq":
        q = _unpack(parts["qweight"], AWQ_ORDER)  # [in, out]
        zeros = _unpack(parts["qzeros"], AWQ_ORDER)
    else:
        q = _unpack(parts["qweight"].t(), tuple(range(8))).t()  # [in, out]
        zeros = _unpack(parts["qzeros"], tuple(range(8))) + qc.zero_offset
    k = q.shape[0]
    groups = scales.shape[0]
    expected = 1 if qc.group_size == -1 else k // qc.group_size
    if groups != expected or k % groups or (k // groups) % BLOCK:
        raise UnsupportedModelError(
            f"{qc.method.upper()} weight {name}: {k} inputs in {groups} groups of scales, not "
            f"groups of group_size={qc.group_size} (a multiple of {BLOCK})"
        )
    g_idx = parts.get("g_idx")
    if g_idx is not None:
        trivial = torch.arange(k, dtype=torch.int64) // (k // groups)
        if not torch.equal(g_idx.to(torch.int64), trivial):
            raise UnsupportedModelError(
                f"GPTQ weight {name} reorders its inputs (desc_act with a g_idx that is not "
                "input // group_size), which enginecore does not support; quantize with "
                "desc_act=false, or with static groups"
            )
    return q.t(), scales.t(), zeros.t().float()


def _weight(
    name: str, parts: dict[str, torch.Tensor], qc: GroupQuantConfig, blocks: bool
) -> torch.Tensor | QuantizedTensor:
    q, scales, zeros = _values(name, parts, qc)
    k = q.shape[1]
    per_block = k // scales.shape[1] // BLOCK
    if blocks:
        d = scales.repeat_interleave(per_block, dim=1)
        m = (-(scales * zeros)).repeat_interleave(per_block, dim=1)
        return int4_blocks(q, d, m)
    group = k // scales.shape[1]
    return (q.float() - zeros.repeat_interleave(group, 1)) * scales.repeat_interleave(group, 1)


def iter_group_quantized(
    weights: Iterator[tuple[str, torch.Tensor]], qc: GroupQuantConfig, blocks: bool
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """``weights`` with each quantized module's tensors (``.qweight``, ``.qzeros``,
    ``.scales``, ``.g_idx``) replaced by its ``.weight``: 4-bit blocks (``blocks``) or
    float32. Quantized parts are held until the end (a module's parts may sit in
    different files)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if leaf in _PARTS:
            pending.setdefault(prefix, {})[leaf] = tensor
        else:
            yield name, tensor
    for prefix, parts in pending.items():
        yield f"{prefix}.weight", _weight(prefix, parts, qc, blocks)
