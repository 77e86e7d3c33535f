"""Reading PEFT LoRA adapters and refusing the ones this engine cannot serve.

An adapter is a directory holding ``adapter_config.json`` and
``adapter_model.safetensors`` (or ``adapter_model.bin``), as PEFT's ``save_pretrained``
writes it. :func:`check_adapter` reads only the config and the safetensors header (the
frontend calls it before a request is queued); :func:`load_adapter` also reads the
weights, folding the scale (``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with
``use_rslora``) into B.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from enginecore.lora_request import LoRAAdapterError

if TYPE_CHECKING:  # the frontend checks adapters without importing torch
    import torch

# The projections adapters may target, by their Hugging Face names.
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<part>lora_[AB])(?:\.[^.]+)?\.weight$"
)


@dataclass
class AdapterInfo:
    """What the config and the header say: enough to accept or refuse the adapter."""

    path: pathlib.Path
    rank: int
    scaling: float
    target_modules: list[str]
    weights_file: pathlib.Path


@dataclass
class LoRAAdapter:
    """An adapter's weights on the host: per module path (Hugging Face naming, e.g.
    ``model.layers.0.self_attn.q_proj``) its A ``[r, in]`` and scaled B ``[out, r]``."""

    lora_int_id: int
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def _fail(path: pathlib.Path, why: str) -> LoRAAdapterError:
    return LoRAAdapterError(f"LoRA adapter {str(path)!r}: {why}")


def check_adapter(lora_path: str, max_lora_rank: int) -> AdapterInfo:
    """Read and check the adapter's config and tensor names; raises
    :class:`LoRAAdapterError` naming what is refused and the setting involved."""
    info = _check_config(lora_path, max_lora_rank)
    _check_names(_tensor_names(info.weights_file, info.path), info)
    return info


def _check_config(lora_path: str, max_lora_rank: int) -> AdapterInfo:
    path = pathlib.Path(lora_path)
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise _fail(path, "no adapter_config.json (give a PEFT adapter directory)")
    try:
        cfg: dict[str, Any] = json.loads(config_file.read_text())
    except ValueError as exc:
        raise _fail(path, f"adapter_config.json is not valid JSON: {exc}") from None
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise _fail(path, f"peft_type {peft_type!r} is not served; only LORA adapters are")
    if cfg.get("use_dora"):
        raise _fail(path, "use_dora=true: DoRA adapters are not served")
    if cfg.get("modules_to_save"):
        raise _fail(
            path,
            f"modules_to_save={cfg['modules_to_save']!r}: adapters that replace whole "
            "modules (embeddings, LM head) are not served",
        )
    if cfg.get("bias", "none") != "none":
        raise _fail(path, f"bias={cfg['bias']!r}: adapters with trained biases are not served")
    if cfg.get("fan_in_fan_out"):
        raise _fail(path, "fan_in_fan_out=true (Conv1D layers) is not served")
    for key in ("rank_pattern", "alpha_pattern", "layers_to_transform"):
        if cfg.get(key):
            raise _fail(path, f"{key} is set: per-layer ranks and scales are not served")
    rank = int(cfg.get("r", 0))
    if rank < 1:
        raise _fail(path, f"r={rank} is not a valid rank")
    if rank > max_lora_rank:
        raise _fail(path, f"rank r={rank} is above max_lora_rank={max_lora_rank} (--max-lora-rank)")
    alpha = float(cfg.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.exists():
        raise _fail(path, "no adapter_model.safetensors")
    return AdapterInfo(path, rank, scaling, [], weights_file)


def _check_names(names: list[str], info: AdapterInfo) -> None:
    """Refuse DoRA, embedding and unknown targets by tensor name; fills the targets."""
    path = info.path
    for name in names:
        if "lora_magnitude_vector" in name:
            raise _fail(path, f"tensor {name!r}: DoRA adapters are not served")
        if "lora_embedding" in name:
            raise _fail(path, f"tensor {name!r}: embedding adapters are not served")
    targets = sorted({_module_of(name, path).rsplit(".", 1)[-1] for name in names})
    bad = [t for t in targets if t not in SUPPORTED_TARGETS]
    if bad:
        raise _fail(
            path,
            f"targets {bad}: only {', '.join(SUPPORTED_TARGETS)} are served (no embedding "
            "or LM-head adapters)",
        )
    if not names:
        raise _fail(path, "adapter_model.safetensors holds no LoRA weights")
    info.target_modules = targets


def _tensor_names(weights_file: pathlib.Path, path: pathlib.Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(weights_file), framework="pt") as f:
            return list(f.keys())
    except Exception as exc:
        raise _fail(path, f"adapter_model.safetensors cannot be read: {exc}") from None


def _module_of(name: str, path: pathlib.Path) -> str:
    match = _KEY.match(name)
    if match is None:
        raise _fail(path, f"tensor {name!r} is not a LoRA A/B weight")
    return match.group("module")


def load_adapter(lora_path: str, lora_int_id: int, max_lora_rank: int) -> LoRAAdapter:
    """Check the adapter, then read its weights (float32, on the host).

    The weights file is read whole with plain reads (no memory map), once: a slow or
    streamed file (a network mount, a pipe) costs its read time and nothing more."""
    info = _check_config(lora_path, max_lora_rank)
    from safetensors.torch import load

    try:
        tensors = load(info.weights_file.read_bytes())
    except Exception as exc:
        raise _fail(info.path, f"adapter_model.safetensors cannot be read: {exc}") from None
    _check_names(list(tensors), info)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _KEY.match(name)
        assert match is not None  # _check_names matched every name
        pairs.setdefault(match.group("module"), {})[match.group("part")] = tensor
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise _fail(info.path, f"module {module!r} lacks lora_A or lora_B")
        a, b = pair["lora_A"].float(), pair["lora_B"].float()
        if a.shape[0] != info.rank or b.shape[1] != info.rank:
            raise _fail(
                info.path,
                f"module {module!r}: A {tuple(a.shape)} / B {tuple(b.shape)} do not have "
                f"the config's rank r={info.rank}",
            )
        weights[module] = (a.contiguous(), (b * info.scaling).contiguous())
    return LoRAAdapter(lora_int_id, info.rank, weights)
