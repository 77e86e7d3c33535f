"""LoRA adapters served on one base model, many in one batch.

:class:`LoRARequest` (what a request names) lives with the wire structs in
``enginecore.lora_request``. ``adapter`` reads and checks PEFT adapters; ``mapping``
groups a step's tokens by adapter slot; ``layer`` adds the delta to one projection
through :class:`enginecore.interfaces.LoRAKernels`; ``torch_kernels`` is the reference
implementation of those kernels; ``manager`` owns a model runner's adapter slots and its
host-memory cache. The package sits below the engine and the layers, above the contract.
"""

from enginecore.lora_request import LoRARequest

__all__ = ["LoRARequest"]
