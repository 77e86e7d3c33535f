"""LoRA load and unload under data parallelism reach every replica: ``LLM.add_lora`` reads
the adapter on both replicas (``lora_state`` per replica's rank), each replica serves it
with PEFT's tokens, and ``LLM.remove_lora`` frees it on both, a request running with it
on replica 1 finishing with it first."""

from __future__ import annotations

import threading
import time

import pytest

from enginecore import LLM, SamplingParams
from enginecore.engine.dp_client import combine_utility_results
from enginecore.lora.random_adapter import make_random_adapter
from enginecore.lora_request import LoRAAdapterError, LoRARequest
from tests.helpers.peft_reference import peft_greedy

pytest.importorskip("peft")

PROMPT = (11, 523, 87, 1999, 4, 250, 31, 77, 908)
SHORT, LONG = 8, 48


def generate(llm: LLM, lora: LoRARequest, max_tokens: int, rank: int) -> list[int]:
    out = llm.generate(
        {"prompt_token_ids": list(PROMPT)},
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        lora_request=lora,
        data_parallel_rank=rank,
        use_tqdm=False,
    )
    return list(out[0].outputs[0].token_ids)


@pytest.mark.slow
def test_lora_load_and_unload_reach_every_replica(tiny_llama, tmp_path):
    adapter = str(make_random_adapter(tiny_llama, tmp_path / "a", r=8, seed=31))
    base = str(tiny_llama)
    with LLM(
        tiny_llama,
        dtype="float32",
        data_parallel_size=2,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        num_blocks_override=64,
        max_model_len=512,
        stat_loggers=[],
    ) as llm:
        lora = LoRARequest("a", 1, adapter)
        assert llm.add_lora(lora) is True
        states = llm.collective_rpc("lora_state")  # one per replica (TP=1)
        assert len(states) == 2
        for replica in states:
            assert replica["host"] == [1] and replica["host_bytes"] > 0, replica
        want = peft_greedy(base, adapter, PROMPT, SHORT)
        assert [generate(llm, lora, SHORT, rank) for rank in (0, 1)] == [want, want]

        # Unloaded while replica 1 runs a request with it: that request finishes with
        # the adapter; then neither replica holds a copy.
        running: list[list[int]] = []
        worker = threading.Thread(target=lambda: running.append(generate(llm, lora, LONG, 1)))
        worker.start()
        deadline = time.monotonic() + 60
        while llm.engine_client.call_utility("get_num_unfinished_requests") == 0:
            assert worker.is_alive() and time.monotonic() < deadline
            time.sleep(0.005)
        assert llm.remove_lora("a") is True
        worker.join(60)
        assert running == [peft_greedy(base, adapter, PROMPT, LONG)]
        for replica in llm.collective_rpc("lora_state"):
            assert replica["host"] == [] and replica["host_bytes"] == 0, replica
            assert replica["slots"] == {} and replica["free_slots"] == 2, replica
        with pytest.raises(LoRAAdapterError, match="'a' was removed"):
            generate(llm, lora, SHORT, 0)


def test_an_unload_is_done_only_when_every_replica_did_it():
    """The fanned-out answers combine to False if any replica's is False (before, the
    first replica's answer stood for all)."""
    assert combine_utility_results("remove_lora", [True, True]) is True
    assert combine_utility_results("remove_lora", [True, False]) is False
    assert combine_utility_results("add_lora", [False, True]) is False
