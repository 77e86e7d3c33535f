"""The model runner's LoRA hook: attach an adapter manager to a loaded model.

Kept apart from the runner so its input preparation stays LoRA-free: the runner calls
:func:`make_lora_manager` after loading, hands new and finished requests to the manager,
and calls ``set_batch(order, query_lens)`` before each forward.
"""

from __future__ import annotations

from typing import Any

from enginecore.lora.manager import LoRAManager
from enginecore.lora.torch_kernels import TorchLoRAKernels


def make_lora_manager(runner: Any) -> LoRAManager:
    """A manager whose deltas are computed by the attention backend's LoRA kernels (the
    torch reference where it has none)."""
    kernels = runner.attn_backend.lora_kernels() or TorchLoRAKernels()
    return LoRAManager(runner.model, runner.config.lora, kernels, runner.dtype, runner.device)
