"""Built-in debugging worker RPCs, registered through ``register_worker_rpcs``.

Each runs inside every worker process as ``fn(worker, ...)`` and returns plain JSON types,
so ``LLM.collective_rpc``, ``POST /collective_rpc`` and ``enginecore rpc`` can all call
them by name. A model runner may answer ``kv_cache_stats`` itself by defining a method of
that name; otherwise the numbers come from the runner's KV cache tensors and block tables.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any


def _parallel_info(worker: Any) -> dict[str, int]:
    par = getattr(worker, "parallel", None)
    return {
        "rank": int(getattr(worker, "rank", 0)),
        "tp_rank": getattr(par, "tp_rank", 0),
        "tp_size": getattr(par, "tp_size", 1),
        "pp_rank": getattr(par, "pp_rank", 0),
        "pp_size": getattr(par, "pp_size", 1),
    }


def _kv_cache_bytes(runner: Any) -> int:
    caches = getattr(runner, "kv_caches", None) or []
    # Layers of different KV cache groups share a tensor: count each tensor once.
    unique = {c.data_ptr(): c for c in caches}.values()
    return int(sum(c.numel() * c.element_size() for c in unique))


def memory_snapshot(worker: Any) -> dict[str, Any]:
    """This rank's device and host memory, and how much of it the KV cache holds."""
    import psutil
    import torch

    device = getattr(worker, "device", None)
    device_info: dict[str, Any] = {"type": getattr(device, "type", "unknown")}
    if device is not None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        device_info.update(
            index=device.index,
            allocated_bytes=torch.cuda.memory_allocated(device),
            reserved_bytes=torch.cuda.memory_reserved(device),
            max_allocated_bytes=torch.cuda.max_memory_allocated(device),
            free_bytes=free,
            total_bytes=total,
        )
    process = psutil.Process()
    mem = process.memory_info()
    system = psutil.virtual_memory()
    runner = getattr(worker, "model_runner", None)
    return {
        **_parallel_info(worker),
        "pid": os.getpid(),
        "device": device_info,
        "host": {
            "rss_bytes": mem.rss,
            "vms_bytes": mem.vms,
            "system_total_bytes": system.total,
            "system_available_bytes": system.available,
        },
        "kv_cache_bytes": _kv_cache_bytes(runner),
        "kv_cache_num_blocks": int(getattr(runner, "num_blocks", 0) or 0),
    }


def kv_cache_stats(worker: Any) -> dict[str, Any]:
    """The KV cache's shape on this rank and how many of its blocks requests hold now."""
    runner = getattr(worker, "model_runner", None)
    own = getattr(runner, "kv_cache_stats", None)
    if callable(own):
        return {**_parallel_info(worker), **own()}
    caches = getattr(runner, "kv_caches", None) or []
    num_blocks = int(getattr(runner, "num_blocks", 0) or 0)
    requests = getattr(runner, "requests", None) or {}
    held = {b for state in requests.values() for b in getattr(state, "block_ids", ())}
    first = caches[0] if caches else None
    return {
        **_parallel_info(worker),
        "num_layers": len(caches),
        "num_blocks": num_blocks,
        "block_size": int(getattr(runner, "block_size", 0) or 0),
        "layer_shape": list(first.shape) if first is not None else None,
        "dtype": str(first.dtype).removeprefix("torch.") if first is not None else None,
        "bytes_per_block": (
            runner.get_kv_cache_block_bytes() if runner is not None and caches else 0
        ),
        "total_bytes": _kv_cache_bytes(runner),
        "num_requests": len(requests),
        "num_blocks_in_use": len(held),
        "usage": len(held) / num_blocks if num_blocks else 0.0,
    }


def model_summary(worker: Any) -> dict[str, Any]:
    """The loaded model on this rank: class, parameter counts by dtype, and each module
    that owns parameters (its shapes show how tensor parallelism sharded it)."""
    runner = getattr(worker, "model_runner", None)
    model = getattr(runner, "model", None)
    if model is None or not hasattr(model, "named_modules"):
        return {**_parallel_info(worker), "model": None, "num_parameters": 0, "layers": []}
    by_dtype: Counter[str] = Counter()
    layers = []
    for name, module in model.named_modules():
        params = list(module.named_parameters(recurse=False))
        if not params:
            continue
        count = sum(p.numel() for _, p in params)
        for _, p in params:
            by_dtype[str(p.dtype).removeprefix("torch.")] += p.numel()
        layers.append(
            {
                "name": name or "<root>",
                "type": type(module).__name__,
                "num_parameters": count,
                "parameters": {
                    pname: {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
                    for pname, p in params
                },
            }
        )
    hf_config = getattr(runner, "hf_config", None)
    return {
        **_parallel_info(worker),
        "model": type(model).__name__,
        "architectures": list(getattr(hf_config, "architectures", None) or []),
        "num_parameters": sum(by_dtype.values()),
        "parameters_by_dtype": dict(by_dtype),
        "layers": layers,
    }


def trace_next_steps(worker: Any, n: int, path: Any = None) -> str:
    """Record the next ``n`` steps this rank runs (SchedulerOutput and timings) as JSON
    lines in the trace directory fixed at start-up (``--trace-dir``); returns the new
    file's path. A caller never chooses the path: the RPC is reachable over the network."""
    from enginecore_executors.step_trace import MAX_TRACE_STEPS, StepTracer

    if path is not None:
        raise ValueError(
            "trace_next_steps takes no path: traces go to the directory the server was "
            "started with (--trace-dir)"
        )
    if isinstance(n, int) and n > MAX_TRACE_STEPS:
        raise ValueError(f"trace_next_steps traces at most {MAX_TRACE_STEPS} steps, got {n}")
    previous = getattr(worker, "step_tracer", None)
    if previous is not None:
        previous.close()
    tracer = StepTracer(worker, n)
    worker.step_tracer = tracer
    return str(tracer.path)


def lora_state(worker: Any) -> dict[str, Any]:
    """This rank's LoRA adapters (``enable_lora``): adapter id -> device slot, free
    slots, adapters read in host memory and their bytes, and the reads begun so far."""
    manager = getattr(getattr(worker, "model_runner", None), "lora", None)
    if manager is None:
        raise ValueError("lora_state: this worker serves no LoRA adapters (enable_lora is off)")
    return {**_parallel_info(worker), **manager.stats()}


DEBUG_RPCS = {
    "memory_snapshot": ("memory_snapshot", "per-rank device/host memory and KV cache size"),
    "kv_cache_stats": ("kv_cache_stats", "KV cache shape, bytes and blocks in use per rank"),
    "model_summary": ("model_summary", "layers, dtypes, parameter counts and sharding"),
    "lora_state": ("lora_state", "LoRA adapters per rank: device slots, host copies, reads"),
    "trace_next_steps": (
        "trace_next_steps",
        "trace_next_steps(n): record the next n SchedulerOutputs and timings to a JSONL file",
    ),
}
