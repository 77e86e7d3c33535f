"""LoRA adapters served on one base model, many in one batch.

``request`` holds :class:`LoRARequest` (what a request names); ``adapter`` reads and
checks PEFT adapters; ``config_check`` refuses settings LoRA does not serve;
``mapping`` groups a step's tokens by adapter slot; ``layer`` adds the delta to one
projection through :class:`enginecore.interfaces.LoRAKernels`; ``torch_kernels`` is the
reference implementation of those kernels; ``manager`` owns a model runner's adapter
slots and its host-memory cache.
"""

from enginecore.lora.request import LoRARequest

__all__ = ["LoRARequest"]
