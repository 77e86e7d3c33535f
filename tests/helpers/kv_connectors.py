"""Requests and a run-to-completion driver for KV-connector tests on a real EngineCore."""

from __future__ import annotations

import random

from enginecore import SamplingParams
from enginecore.engine.core import EngineCore
from enginecore.protocol import EngineCoreRequest

BLOCK = 16


def seeded_prompts(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(10, 8000) for _ in range(48)]
    return [
        prefix + [rng.randrange(10, 8000) for _ in range(22)],  # 70 tokens
        prefix + [rng.randrange(10, 8000) for _ in range(39)],  # 87: shares 3 blocks
        [rng.randrange(10, 8000) for _ in range(40)],
    ]


def run_to_completion(engine: EngineCore, requests: list[EngineCoreRequest]) -> dict[str, dict]:
    """Step an in-process engine until idle: per-request results, plus summed "stats"."""
    for request in requests:
        engine.add_request(request)
    results: dict[str, dict] = {
        "stats": {"num_kv_loaded_tokens": 0, "num_prompt_tokens_computed": 0}
    }
    while engine.has_work():
        outputs, _ = engine.step()
        for client in outputs.values():
            if client.scheduler_stats is not None:
                for key in results["stats"]:
                    results["stats"][key] += getattr(client.scheduler_stats, key)
            for out in client.outputs:
                entry = results.setdefault(out.request_id, {"tokens": [], "error": None})
                if out.new_token_ids and not entry["tokens"]:
                    entry["num_cached_tokens"] = out.num_cached_tokens
                entry["tokens"] += out.new_token_ids
                entry["error"] = entry["error"] or out.error
                entry["finish_reason"] = out.finish_reason
    return results


def engine_request(req_id: str, prompt: list[int], max_tokens: int = 4) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=req_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        arrival_time=0.0,
    )
