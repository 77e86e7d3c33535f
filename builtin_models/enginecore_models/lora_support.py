"""The model runner's LoRA hook: attach an adapter manager to a loaded model.

Kept apart from the runner so its input preparation stays LoRA-free: the runner calls
:func:`make_lora_manager` after loading, hands new and finished requests to the manager,
calls ``set_batch(order, query_lens)`` before each forward, and ``finish_preload()`` at the
end of start-up (the ``--lora-modules`` adapters, whose reads begin here).
"""

from __future__ import annotations

import logging
from typing import Any

from enginecore.interfaces import AttentionBackend
from enginecore.lora.manager import LoRAManager
from enginecore.lora.modules import host_capacity, lora_module_requests, preloaded_requests
from enginecore.lora.torch_kernels import TorchLoRAKernels

logger = logging.getLogger(__name__)
_fused_decode_noted = False


def note_fused_decode_off(backend: Any) -> None:
    """Say once per process why a backend's whole-step decode kernel is not used with
    LoRA: it runs every projection inside one foreign call, with no point between them
    where the adapters' delta could be added, so decode steps run layer by layer."""
    global _fused_decode_noted
    if _fused_decode_noted or type(backend).fused_decode is AttentionBackend.fused_decode:
        return
    _fused_decode_noted = True
    logger.info(
        "LoRA: the %s attention backend's fused decode step is off (it runs every "
        "projection in one foreign call, with no point to add the adapters' delta); "
        "decode steps run layer by layer",
        type(backend).__name__,
    )


def make_lora_manager(runner: Any) -> LoRAManager:
    """A manager whose deltas are computed by the attention backend's LoRA kernels (the
    torch reference where it has none)."""
    config = runner.config.lora
    kernels = runner.attn_backend.lora_kernels() or TorchLoRAKernels()
    manager = LoRAManager(runner.model, config, kernels, runner.dtype, runner.device)
    # The --lora-modules adapters read while start-up goes on (finish_preload waits).
    later = lora_module_requests(config)[host_capacity(config) :]
    manager.preload(preloaded_requests(config), checked=later)
    if later:
        logger.warning(
            "--lora-modules names %d adapters but host memory keeps %d (max_cpu_loras): "
            "%s checked now, read when a request first names them",
            len(config.lora_modules),
            host_capacity(config),
            ", ".join(repr(r.lora_name) for r in later),
        )
    return manager
