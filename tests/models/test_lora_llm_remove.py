"""``LLM.remove_lora(name)`` as the server's ``/v1/unload_lora_adapter``: a request
already running with the adapter (a ``generate`` in another thread) finishes with it
(PEFT's tokens), every rank frees its device slot and host copy (``lora_state``), a new
request naming it is refused with the call that brings it back, and ``LLM.add_lora``
loads the name again from another path, serving the new weights."""

from __future__ import annotations

import threading
import time

import pytest

from enginecore import LLM, SamplingParams
from enginecore.errors import ConfigError
from enginecore.lora.random_adapter import make_random_adapter
from enginecore.lora_request import LoRAAdapterError, LoRARequest
from tests.helpers.peft_reference import peft_greedy

pytest.importorskip("peft")

PROMPT = (11, 523, 87, 1999, 4, 250, 31, 77, 908)
SHORT, LONG = 8, 48


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def tokens(llm: LLM, lora: LoRARequest, max_tokens: int) -> list[int]:
    out = llm.generate(
        {"prompt_token_ids": list(PROMPT)}, params(max_tokens), lora_request=lora, use_tqdm=False
    )
    return list(out[0].outputs[0].token_ids)


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("llm_remove")
    first = make_random_adapter(tiny_llama, root / "first", r=8, seed=21)
    second = make_random_adapter(
        tiny_llama, root / "second", r=4, target_modules=("v_proj", "up_proj"), seed=22
    )
    return str(first), str(second)


@pytest.mark.parametrize("executor,tp", [("uni", 1), pytest.param("mp", 2, marks=pytest.mark.slow)])
def test_llm_remove_lora_frees_every_rank_and_refuses_the_name(tiny_llama, adapters, executor, tp):
    first, second = adapters
    base = str(tiny_llama)
    with LLM(
        tiny_llama,
        dtype="float32",
        executor=executor,
        tensor_parallel_size=tp,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        num_blocks_override=64,
        stat_loggers=[],
    ) as llm:
        lora = LoRARequest("a", 1, first)
        assert tokens(llm, lora, SHORT) == peft_greedy(base, first, PROMPT, SHORT)
        for rank in llm.collective_rpc("lora_state"):
            assert rank["host"] == [1] and "1" in rank["slots"], rank

        # Removed while a generate in another thread runs with it: that request finishes
        # with the adapter, then every rank frees it.
        running: list[list[int]] = []
        worker = threading.Thread(target=lambda: running.append(tokens(llm, lora, LONG)))
        worker.start()
        deadline = time.monotonic() + 60
        while llm.engine_client.call_utility("get_num_unfinished_requests") == 0:
            assert worker.is_alive() and time.monotonic() < deadline
            time.sleep(0.005)
        assert llm.remove_lora("a") is True
        worker.join(60)
        assert running == [peft_greedy(base, first, PROMPT, LONG)]
        states = llm.collective_rpc("lora_state")
        assert len(states) == tp
        for rank in states:
            assert rank["host"] == [] and rank["host_bytes"] == 0, rank
            assert rank["slots"] == {} and rank["free_slots"] == 2, rank

        # A new request naming it is refused, saying how to bring it back; so is a
        # second removal. Nothing ran meanwhile.
        with pytest.raises(LoRAAdapterError, match=r"'a' was removed .*LLM\.add_lora"):
            tokens(llm, lora, SHORT)
        with pytest.raises(LoRAAdapterError, match="no LoRA adapter named 'a'"):
            llm.remove_lora("a")
        assert llm.engine_client.call_utility("get_num_unfinished_requests") == 0

        # Loaded again under the same name from another path: the new weights serve.
        again = LoRARequest("a", 2, second)
        assert llm.add_lora(again) is True
        for rank in llm.collective_rpc("lora_state"):
            assert rank["host"] == [2], rank
        assert tokens(llm, again, SHORT) == peft_greedy(base, second, PROMPT, SHORT)


@pytest.mark.slow  # a whole engine for one message
def test_in_process_engine_refuses_lora_calls_by_name(tiny_llama):
    with LLM(
        tiny_llama, dtype="float32", multiprocessing=False, enable_lora=True, stat_loggers=[]
    ) as llm:
        with pytest.raises(ConfigError, match=r"LLM\.remove_lora needs the engine core in its own"):
            llm.remove_lora("a")
        with pytest.raises(ConfigError, match=r"LLM\.add_lora needs .*\(multiprocessing = false"):
            llm.add_lora(LoRARequest("a", 1, "/nonexistent"))
