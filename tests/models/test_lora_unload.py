"""Unloading a LoRA adapter frees every worker's copies: its device slot and its host
copy, on every rank (``uni``, and ``mp`` with TP=2), seen through the ``lora_state``
RPC before and after. A request running with the adapter while it is unloaded finishes
with it first (PEFT's tokens), and an adapter loaded again from another path serves the
new weights."""

from __future__ import annotations

import asyncio

import pytest

from enginecore import AsyncLLM, SamplingParams
from enginecore.lora.random_adapter import make_random_adapter
from enginecore.lora_request import LoRARequest
from tests.helpers.peft_reference import peft_greedy

pytest.importorskip("peft")

MAX_TOKENS = 8
PROMPT = [11, 523, 87, 1999, 4, 250, 31, 77, 908]


def peft_tokens(base: str, adapter: str) -> list[int]:
    return peft_greedy(base, adapter, tuple(PROMPT), MAX_TOKENS)


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("unload")
    first = make_random_adapter(tiny_llama, root / "first", r=8, seed=11)
    second = make_random_adapter(
        tiny_llama, root / "second", r=4, target_modules=("k_proj", "down_proj"), seed=12
    )
    return str(first), str(second)


async def tokens_of(engine: AsyncLLM, req_id: str, lora: LoRARequest, started=None) -> list[int]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens: list[int] = []
    async for out in engine.generate(
        {"prompt_token_ids": PROMPT}, params, req_id, lora_request=lora
    ):
        tokens.extend(out.outputs[0].token_ids)
        if started is not None and not started.is_set():
            started.set()
    return tokens


@pytest.mark.parametrize("executor,tp", [("uni", 1), pytest.param("mp", 2, marks=pytest.mark.slow)])
def test_unload_frees_every_workers_copies(tiny_llama, adapters, executor, tp):
    first, second = adapters
    base = str(tiny_llama)

    async def scenario() -> None:
        engine = AsyncLLM(
            tiny_llama,
            dtype="float32",
            executor=executor,
            tensor_parallel_size=tp,
            enable_lora=True,
            max_loras=2,
            max_lora_rank=8,
            num_blocks_override=64,
            stat_loggers=[],
        )
        try:
            lora = LoRARequest("a", 1, first)
            assert await engine.add_lora(lora)
            # Running the request puts the adapter into a device slot on every rank.
            assert await tokens_of(engine, "warm", lora) == peft_tokens(base, first)
            before = await engine.collective_rpc("lora_state")
            assert len(before) == tp
            for rank in before:
                assert rank["host"] == [1] and rank["host_bytes"] > 0, rank
                assert "1" in rank["slots"] and rank["free_slots"] == 1, rank

            # Unloaded while a request runs with it: the request finishes first.
            started = asyncio.Event()
            running = asyncio.create_task(tokens_of(engine, "running", lora, started))
            await started.wait()
            assert await engine.remove_lora(1)
            assert running.done()
            assert running.result() == peft_tokens(base, first)
            for rank in await engine.collective_rpc("lora_state"):
                assert rank["host"] == [] and rank["host_bytes"] == 0, rank
                assert rank["slots"] == {} and rank["free_slots"] == 2, rank

            # The same name loaded again from another path (a new id, as the server
            # gives it): the new weights are read and served.
            again = LoRARequest("a", 2, second)
            assert await engine.add_lora(again)
            assert await tokens_of(engine, "again", again) == peft_tokens(base, second)
            for rank in await engine.collective_rpc("lora_state"):
                assert rank["host"] == [2] and list(rank["slots"]) == ["2"], rank
        finally:
            engine.shutdown()

    asyncio.run(scenario())
