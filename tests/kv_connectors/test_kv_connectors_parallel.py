"""KV connectors with tensor and pipeline parallelism: each rank moves its own shard.

A request's transfer is finished only when every rank reported it (the ranks may report
in different steps); the built-in connectors then work at TP=2 and PP=2: shared_storage
stores one file per block and rank and a second engine loads them all; zmq_p2p pulls each
rank's shard from the prefill rank of the same index.
"""

from __future__ import annotations

import pytest

from enginecore import LLM, SamplingParams, make_config
from enginecore.engine.core import EngineCore
from enginecore.kv_aggregation import KVOutputAggregator
from enginecore.runner_output import KVConnectorOutput, ModelRunnerOutput
from enginecore.testing.kv_connector_contract import free_port
from tests.helpers.hf_reference import assert_matches_reference, greedy_reference
from tests.helpers.kv_connectors import BLOCK, engine_request, run_to_completion, seeded_prompts


def test_a_transfer_finishes_when_every_rank_reported_it() -> None:
    agg = KVOutputAggregator(world_size=2)
    step1 = agg.merge(
        [KVConnectorOutput(finished_sending={"a", "b"}), KVConnectorOutput(finished_sending={"a"})]
    )
    assert step1.finished_sending == {"a"}
    step2 = agg.merge([None, KVConnectorOutput(finished_sending={"b"}, finished_recving={"c"})])
    assert step2.finished_sending == {"b"} and step2.finished_recving == set()
    step3 = agg.merge(
        [
            KVConnectorOutput(finished_recving={"c"}, invalid_block_ids={7}),
            KVConnectorOutput(failures={"d": "rank 1: disk full"}),
        ]
    )
    assert step3.finished_recving == {"c"}
    assert step3.invalid_block_ids == {7} and step3.failures == {"d": "rank 1: disk full"}


def test_reports_of_a_step_without_output_are_kept_for_the_next() -> None:
    agg = KVOutputAggregator(world_size=2)
    quiet = [
        ModelRunnerOutput(kv_connector_output=KVConnectorOutput(finished_sending={"a"})),
        None,
    ]
    assert agg.merge_outputs(quiet, output_rank=1) is None
    later = [None, ModelRunnerOutput(kv_connector_output=KVConnectorOutput(finished_sending={"a"}))]
    assert agg.merge_outputs(later, output_rank=1).kv_connector_output.finished_sending == {"a"}


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_shared_storage_with_tp_or_pp_saves_every_shard_and_loads_them(
    tiny_llama, tmp_path, tp, pp
) -> None:
    prompts = seeded_prompts()
    store = tmp_path / "kv"
    config = make_config(
        model=str(tiny_llama),
        dtype="float32",
        block_size=BLOCK,
        num_blocks_override=128,
        max_model_len=512,
        stat_loggers=[],
        executor="mp",
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        kv_transfer={"connector": "shared_storage", "extra_config": {"path": str(store)}},
    )
    runs = []
    for _ in range(2):
        engine = EngineCore(config)
        try:
            requests = [engine_request(f"p{i}", p, max_tokens=8) for i, p in enumerate(prompts)]
            runs.append(run_to_completion(engine, requests))
            assert engine.scheduler.leak_report() == []
        finally:
            engine.shutdown()
    first, second = runs
    files = sorted(f.name.split(".")[1] for f in store.rglob("*.kvblock"))
    assert files == ["rank0"] * 8 + ["rank1"] * 8, "one file per block and rank"
    loaded = [64, 80, 32]
    assert [second[f"p{i}"]["num_cached_tokens"] for i in range(3)] == loaded
    assert second["stats"]["num_kv_loaded_tokens"] == sum(loaded)
    for i, prompt in enumerate(prompts):
        assert second[f"p{i}"]["tokens"] == first[f"p{i}"]["tokens"]
        assert_matches_reference(
            second[f"p{i}"]["tokens"], greedy_reference(tiny_llama, prompt, 8), f"prompt {i}"
        )


@pytest.mark.slow
def test_zmq_p2p_tp2_prefill_then_tp2_decode(tiny_llama) -> None:
    common = dict(
        dtype="float32",
        block_size=BLOCK,
        num_blocks_override=128,
        max_model_len=512,
        tensor_parallel_size=2,
    )
    port = free_port()
    prompts = seeded_prompts()[:2]
    prefill = LLM(
        str(tiny_llama),
        kv_transfer={
            "connector": "zmq_p2p",
            "role": "kv_producer",
            # its own "host": an address of its own on the loopback network
            "extra_config": {"host": "127.0.0.2", "port": port},
        },
        **common,
    )
    try:
        decode = LLM(
            str(tiny_llama),
            kv_transfer={
                "connector": "zmq_p2p",
                "role": "kv_consumer",
                "extra_config": {"peers": [f"127.0.0.2:{port}"]},
            },
            **common,
        )
        try:
            handles = prefill.generate(
                [{"prompt_token_ids": p} for p in prompts],
                SamplingParams(
                    max_tokens=1, temperature=0.0, kv_transfer_params={"do_remote_decode": True}
                ),
            )
            assert handles[0].kv_transfer_params["remote_host"] == "127.0.0.2"
            outs = [
                decode.generate(
                    {"prompt_token_ids": p},
                    SamplingParams(
                        max_tokens=8,
                        temperature=0.0,
                        ignore_eos=True,
                        kv_transfer_params=h.kv_transfer_params,
                    ),
                )[0]
                for p, h in zip(prompts, handles, strict=True)
            ]
            # the prefill side freed every held block once both ranks were fetched from
            assert prefill.engine_client.call_utility("get_num_unfinished_requests") == 0
        finally:
            decode.shutdown()
    finally:
        prefill.shutdown()
    for i, out in enumerate(outs):
        assert out.error is None
        reference = greedy_reference(tiny_llama, prompts[i], 8)
        assert_matches_reference(out.outputs[0].token_ids, reference, f"prompt {i}")
    assert [o.num_cached_tokens for o in outs] == [64, 80]
