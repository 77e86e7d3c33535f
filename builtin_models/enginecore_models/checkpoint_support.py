"""Refuse, at load, the checkpoints enginecore would otherwise run wrong.

A quantized checkpoint's ``quantization_config`` names its method (FP8, AWQ, GPTQ,
bitsandbytes...); the weight loader reads plain tensors only, so loading one would
either miss weights or, worse, multiply raw quantized values and generate garbage. Such
checkpoints stop here with the method's name and what does load. A model class that
raises ``NotImplementedError`` for a config option is reported the same way, naming the
architecture, never the executor that happened to be loading it.
"""

from __future__ import annotations

import pathlib
from typing import Any

from enginecore.errors import UnsupportedModelError
from enginecore_models.group_quant import group_quant_config

SUPPORTED_WEIGHTS = (
    "unquantized safetensors (float32, bfloat16, float16), 4-bit group-wise AWQ and GPTQ "
    "checkpoints, and GGUF files (F32, F16, BF16 and the llama.cpp block types)"
)


def architecture_name(hf_config: Any) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    return archs[0] if archs else getattr(hf_config, "model_type", "model")


def quantization_method(hf_config: Any) -> str | None:
    """The checkpoint's quantization method, or None for an unquantized one."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    return str(qc.get("quant_method") or qc.get("quantization_method") or "unknown")


def check_supported_checkpoint(hf_config: Any, path: str | pathlib.Path) -> None:
    method = quantization_method(hf_config)
    if method is None or group_quant_config(hf_config) is not None:
        return
    raise UnsupportedModelError(
        f"{architecture_name(hf_config)} checkpoint {str(path)!r} is quantized with "
        f"{method!r} (config.json quantization_config), which enginecore does not "
        f"support. Supported: {SUPPORTED_WEIGHTS}. Use the unquantized checkpoint or a "
        "GGUF file of the model."
    )


def unsupported_feature(hf_config: Any, path: str | pathlib.Path, exc: Exception) -> Exception:
    """The error for a model class that refused the checkpoint: names the model."""
    return UnsupportedModelError(
        f"{architecture_name(hf_config)} checkpoint {str(path)!r} uses a feature enginecore "
        f"does not support: {exc}"
    )
