"""The ``--lora-modules`` adapters: read by every worker while the engine starts.

vLLM preloads the adapters named at start-up, so the first request naming one pays no
read. Each entry ``name=path`` gets the id of its place in the list (1, 2, ...); the
server's adapter list, the scheduler (which admits their requests at once) and the
workers (which read them) all derive the same ids from the config here. The first
``max_cpu_loras`` entries are read at start-up (the first ``max_loras`` of them copied
into the device slots); any beyond that are read when a request first names them.
"""

from __future__ import annotations

from enginecore.config import LoRAConfig
from enginecore.lora_request import LoRARequest


def lora_module_requests(config: LoRAConfig) -> list[LoRARequest]:
    """Every ``lora_modules`` entry as a request, ids 1..N in the order given."""
    if not config.enable_lora:
        return []
    requests = []
    for lora_int_id, entry in enumerate(config.lora_modules, start=1):
        name, _, path = entry.partition("=")
        requests.append(LoRARequest(name, lora_int_id, path))
    return requests


def host_capacity(config: LoRAConfig) -> int:
    """Adapters kept read in host memory (``max_cpu_loras``, by default ``max_loras``)."""
    return config.max_cpu_loras or config.max_loras


def preloaded_requests(config: LoRAConfig) -> list[LoRARequest]:
    """The ``lora_modules`` entries read at start-up: as many as host memory keeps."""
    return lora_module_requests(config)[: host_capacity(config)]
