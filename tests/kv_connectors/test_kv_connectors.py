"""KV connectors end to end: shared_storage across engine processes, zmq_p2p prefill ->
decode, corrupted blocks recomputed, a raising connector failing only its request."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from enginecore import LLM, AsyncLLM, SamplingParams, make_config
from enginecore.engine.async_llm import RequestRejectedError
from enginecore.engine.core import EngineCore
from enginecore.engine.output import OutputKind
from enginecore.errors import ConfigError
from enginecore.plugins import make_plugin_manager
from enginecore.server.errors import status_of
from enginecore.testing.kv_connector_contract import free_port
from enginecore_kv_connectors.shared_storage import (
    SharedStorageConnector,
    SharedStorageScheduler,
    SharedStorageWorker,
)
from tests.helpers.hf_reference import assert_matches_reference, greedy_reference
from tests.helpers.kv_connectors import BLOCK, engine_request, run_to_completion, seeded_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _stats(path) -> list[dict]:
    lines = [json.loads(x) for x in path.read_text().splitlines() if x]
    return [line["scheduler"] for line in lines if line["scheduler"]]


def _engine_kwargs(store) -> dict:
    return dict(
        dtype="float32",
        block_size=BLOCK,
        num_blocks_override=128,
        max_model_len=512,
        stat_loggers=["jsonl"],
        kv_transfer={"connector": "shared_storage", "extra_config": {"path": str(store)}},
    )


async def _serve_once(path, store, prompts) -> list:
    """One AsyncLLM engine process (with the jsonl stat logger) generating every prompt."""
    llm = AsyncLLM(path, **_engine_kwargs(store))
    try:

        async def one(i: int, prompt: list[int]):
            final = None
            async for out in llm.generate(
                {"prompt_token_ids": prompt}, GREEDY, f"p{i}", output_kind=OutputKind.FINAL_ONLY
            ):
                final = out
            return final

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_shared_storage_second_engine_skips_prefill(tiny_llama, tmp_path, monkeypatch):
    """Two engine processes, one directory: the second loads what the first computed,
    computes only the tails and answers exactly as the first (and transformers)."""
    store = tmp_path / "kv"
    prompts = seeded_prompts()
    first_stats, second_stats = tmp_path / "first.jsonl", tmp_path / "second.jsonl"

    monkeypatch.setenv("ENGINECORE_JSONL_STATS_PATH", str(first_stats))
    first = asyncio.run(_serve_once(tiny_llama, store, prompts))
    saved = list(store.rglob("*.kvblock"))
    # Full prompt blocks: 70 -> 4, 87 -> 5 (3 shared with the first), 40 -> 2.
    assert len(saved) == 4 + 2 + 2

    monkeypatch.setenv("ENGINECORE_JSONL_STATS_PATH", str(second_stats))
    second = asyncio.run(_serve_once(tiny_llama, store, prompts))

    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, f"prompt {i}"
    reference = greedy_reference(tiny_llama, prompts[1], 8)
    assert_matches_reference(second[1].outputs[0].token_ids, reference, "prompt 1")
    # Loaded: every full block except the one holding each prompt's last token.
    loaded = [64, 80, 32]
    assert [o.num_cached_tokens for o in second] == loaded
    stats = _stats(second_stats)
    assert sum(s["num_kv_loaded_tokens"] for s in stats) == sum(loaded)
    # The second engine's prefill computed only the tails.
    tails = sum(len(p) - n for p, n in zip(prompts, loaded, strict=True))
    assert sum(s["num_prompt_tokens_computed"] for s in stats) == tails
    local_hits = sum(o.num_cached_tokens for o in first)
    first_prefill = sum(s["num_prompt_tokens_computed"] for s in _stats(first_stats))
    assert first_prefill == sum(len(p) for p in prompts) - local_hits
    assert sum(s["num_kv_loaded_tokens"] for s in _stats(first_stats)) == 0


def test_shared_storage_in_process_engines_share_prefixes(tiny_llama, tmp_path):
    """The same, fast: two in-process engines one after the other; the scheduler stats
    of the second show only the tails computed."""
    prompts = seeded_prompts()
    config = make_config(model=str(tiny_llama), **_engine_kwargs(tmp_path) | {"stat_loggers": []})
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
    for i in range(len(prompts)):
        assert second[f"p{i}"]["tokens"] == first[f"p{i}"]["tokens"]
    loaded = [64, 80, 32]
    assert [second[f"p{i}"]["num_cached_tokens"] for i in range(3)] == loaded
    assert second["stats"]["num_kv_loaded_tokens"] == sum(loaded)
    tails = sum(len(p) - n for p, n in zip(prompts, loaded, strict=True))
    assert second["stats"]["num_prompt_tokens_computed"] == tails
    local_hits = sum(first[f"p{i}"]["num_cached_tokens"] for i in range(3))
    assert first["stats"]["num_prompt_tokens_computed"] == sum(map(len, prompts)) - local_hits


def test_corrupted_or_truncated_blocks_are_recomputed(tiny_llama, tmp_path):
    store = tmp_path / "kv"
    prompt = seeded_prompts()[0]
    kwargs = _engine_kwargs(store) | {"multiprocessing": False, "stat_loggers": []}
    with LLM(str(tiny_llama), **kwargs) as llm:
        expected = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids
    from enginecore_kv_connectors.kv_blocks import prefix_keys

    keys = prefix_keys(prompt, BLOCK)
    files = {p.stem: p for p in store.rglob("*.kvblock")}
    corrupt, truncate = files[keys[2]], files[keys[3]]
    raw = bytearray(corrupt.read_bytes())
    raw[-100] ^= 0xFF  # one flipped byte in the payload
    corrupt.write_bytes(bytes(raw))
    truncate.write_bytes(truncate.read_bytes()[:-1000])

    with LLM(str(tiny_llama), **kwargs) as llm:
        out = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
        # Blocks 0-1 were good and used; from the bad block 2 on, recomputed.
        assert out.num_cached_tokens == 2 * BLOCK
        assert out.outputs[0].token_ids == expected
        scheduler = llm.engine_client.engine.scheduler
        assert scheduler.leak_report() == [] or _quiet(llm) == []
    # The bad files were replaced by good ones when the blocks were recomputed.
    with LLM(str(tiny_llama), **kwargs) as llm:
        out = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
        assert out.num_cached_tokens == 4 * BLOCK
        assert out.outputs[0].token_ids == expected


def _quiet(llm: LLM) -> list[str]:
    engine = llm.engine_client.engine
    step = engine.step_fn()
    while engine.has_work():
        step()
    return engine.scheduler.leak_report()


# --- a connector that raises ----------------------------------------------------------


class RaisingWorker(SharedStorageWorker):
    """Raises for requests whose id says so: on load ("bad-load") or on save ("bad-save")."""

    def start_load_kv(self, metadata):
        if metadata is not None and any(j.req_id.startswith("bad-load") for j in metadata.loads):
            raise OSError("disk on fire")
        return super().start_load_kv(metadata)

    def save_kv_layer(self, layer_name, kv_layer, metadata):
        if metadata is not None and any(j.req_id.startswith("bad-save") for j in metadata.saves):
            raise RuntimeError("cannot save")
        return super().save_kv_layer(layer_name, kv_layer, metadata)


class RaisingConnector(SharedStorageConnector):
    def worker_side(self, config, rank):
        return RaisingWorker(config, rank)


class _RaisingPlugin:
    import enginecore as _ec

    @staticmethod
    @_ec.hookimpl
    def register_kv_connectors(registry):
        registry.add("raising_storage", RaisingConnector)


def test_raising_connector_fails_only_the_affected_request(tiny_llama, tmp_path):
    host = make_plugin_manager(load_entrypoints=False)
    host.register_object(_RaisingPlugin(), "raising")
    config = make_config(
        model=str(tiny_llama),
        dtype="float32",
        block_size=BLOCK,
        num_blocks_override=64,
        max_model_len=512,
        async_scheduling=False,
        kv_transfer={"connector": "raising_storage", "extra_config": {"path": str(tmp_path)}},
    )
    long_prompt, _, stored = seeded_prompts()
    short = stored[:10]  # shorter than a block: nothing to save or load
    engine = EngineCore(config, host)
    try:
        assert run_to_completion(engine, [engine_request("seed", stored)])["seed"]["error"] is None
        # A raising save fails the request it was saving; the other one in the step runs on.
        results = run_to_completion(
            engine, [engine_request("bad-save", long_prompt), engine_request("good-1", short)]
        )
        assert results["bad-save"]["finish_reason"] == 3  # FinishReason.ERROR
        assert (
            "RaisingWorker.save_kv_layer raised RuntimeError: cannot save"
            in (results["bad-save"]["error"])
        )
        assert results["good-1"]["error"] is None and len(results["good-1"]["tokens"]) == 4
        # A raising load fails the loading request only (with no local prefix hit).
        assert engine.reset_prefix_cache()
        results = run_to_completion(
            engine, [engine_request("bad-load", stored), engine_request("good-2", short[:5])]
        )
        assert "start_load_kv raised OSError: disk on fire" in results["bad-load"]["error"]
        assert results["good-2"]["error"] is None and len(results["good-2"]["tokens"]) == 4
        # The store still serves the same blocks to the next request.
        assert engine.reset_prefix_cache()
        results = run_to_completion(engine, [engine_request("good-3", stored)])
        assert results["good-3"]["error"] is None and len(results["good-3"]["tokens"]) == 4
        assert engine.scheduler.leak_report() == []
    finally:
        engine.shutdown()


def test_shared_storage_needs_a_path(tiny_llama):
    with pytest.raises(ConfigError, match=r"kv_transfer\.extra_config\.path"):
        LLM(str(tiny_llama), multiprocessing=False, kv_transfer={"connector": "shared_storage"})


def test_zmq_p2p_rejects_unknown_settings(tiny_llama):
    with pytest.raises(ConfigError, match=r"kv_transfer\.extra_config"):
        LLM(
            str(tiny_llama),
            multiprocessing=False,
            kv_transfer={"connector": "zmq_p2p", "extra_config": {"prot": 1}},
        )


# --- disaggregated prefill/decode ------------------------------------------------------


@pytest.mark.slow
def test_zmq_p2p_prefill_then_decode_matches_one_engine(tiny_llama):
    """Prefill and decode engines in their own processes; the decode engine fetches the
    prompt KV over ZeroMQ (CURVE, keys from the shared secret) and continues exactly like
    a single engine."""
    common = dict(dtype="float32", block_size=BLOCK, num_blocks_override=128, max_model_len=512)
    port = free_port()
    prompts = seeded_prompts()
    secret = {"secret": "shared by both instances"}
    prefill = LLM(
        str(tiny_llama),
        kv_transfer={
            "connector": "zmq_p2p",
            "role": "kv_producer",
            "extra_config": {"port": port, **secret},
        },
        **common,
    )
    try:
        decode = LLM(
            str(tiny_llama),
            kv_transfer={
                "connector": "zmq_p2p",
                "role": "kv_consumer",
                "extra_config": {"peers": [f"127.0.0.1:{port}"], **secret},
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
            assert handles[0].kv_transfer_params["remote_port"] == port
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
        finally:
            decode.shutdown()
    finally:
        prefill.shutdown()
    for i, out in enumerate(outs):
        assert out.error is None
        assert out.outputs[0].token_ids[0] == handles[i].outputs[0].token_ids[0]
        reference = greedy_reference(tiny_llama, prompts[i], 8)
        assert_matches_reference(out.outputs[0].token_ids, reference, f"prompt {i}")
    assert [o.num_cached_tokens for o in outs] == [64, 80, 32]


def test_zmq_p2p_off_loopback_needs_a_secret():
    from enginecore_kv_connectors.zmq_p2p import P2PSettings

    config = make_config(
        model="unused", kv_transfer={"connector": "zmq_p2p", "extra_config": {"host": "10.1.2.3"}}
    )
    with pytest.raises(ConfigError, match="needs a shared secret"):
        P2PSettings.of(config)


def test_zmq_p2p_a_peer_with_another_secret_gets_no_block():
    """The producer's block socket admits only keys derived from its secret: a consumer
    with another one (or none) gets no answer, and says so."""
    from enginecore_kv_connectors.zmq_p2p import FetchJob, ZmqP2PWorker

    port = free_port()

    def worker(role: str, secret: str | None) -> ZmqP2PWorker:
        extra = {"port": port, "recv_timeout": 1.0, **({"secret": secret} if secret else {})}
        if role == "kv_consumer":
            extra["peers"] = [f"127.0.0.1:{port}"]
        config = make_config(
            model="unused",
            kv_transfer={"connector": "zmq_p2p", "role": role, "extra_config": extra},
        )
        return ZmqP2PWorker(config, 0)

    producer = worker("kv_producer", "the right one")
    try:
        for secret in ("a wrong one", None):
            consumer = worker("kv_consumer", secret)
            try:
                job = FetchJob("r", "127.0.0.1", port, "remote", 0, [0], ["k"])
                with pytest.raises(TimeoutError, match="no answer from the prefill instance"):
                    consumer._fetch(job)
            finally:
                consumer.shutdown()
    finally:
        producer.shutdown()


def test_zmq_p2p_unreachable_prefill_fails_the_request_clearly(tiny_llama):
    gone = free_port()  # a configured producer that is not running
    with LLM(
        str(tiny_llama),
        multiprocessing=False,
        dtype="float32",
        num_blocks_override=64,
        kv_transfer={
            "connector": "zmq_p2p",
            "role": "kv_consumer",
            "extra_config": {"recv_timeout": 0.5, "peers": [f"127.0.0.1:{gone}"]},
        },
    ) as llm:
        handle = {
            "do_remote_prefill": True,
            "remote_host": "127.0.0.1",
            "remote_port": gone,
            "remote_request_id": "gone",
            "num_tokens": 64,
        }
        prompt = seeded_prompts()[0]
        out = llm.generate(
            {"prompt_token_ids": prompt},
            SamplingParams(max_tokens=4, temperature=0.0, kv_transfer_params=handle),
        )[0]
        assert out.outputs[0].finish_reason == "error"
        assert "no answer from the prefill instance" in out.error
        # The server answers it with 502: the prefill instance failed, not the request.
        assert status_of(RequestRejectedError(out.error)) == 502
        assert status_of(RequestRejectedError("ValueError: not a valid grammar")) == 400
        # Other requests are unaffected.
        ok = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=4))[0]
        assert ok.error is None and len(ok.outputs[0].token_ids) == 4
        assert _quiet(llm) == []


# --- a connector that loads synchronously (inside the step) ----------------------------


class SyncStorageScheduler(SharedStorageScheduler):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        num, _ = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return num, False  # loaded during the request's first step


class SyncStorageWorker(SharedStorageWorker):
    def start_load_kv(self, metadata):
        for job in metadata.loads if metadata is not None else ():
            self._invalid_blocks |= self._load(job)  # before the forward pass reads them


class SyncStorageConnector(SharedStorageConnector):
    def scheduler_side(self, config):
        return SyncStorageScheduler(config)

    def worker_side(self, config, rank):
        return SyncStorageWorker(config, rank)


class _SyncPlugin:
    import enginecore as _ec

    @staticmethod
    @_ec.hookimpl
    def register_kv_connectors(registry):
        registry.add("sync_storage", SyncStorageConnector)


def test_synchronous_loads_bypass_the_decode_mirror_and_recompute_bad_blocks(tiny_llama, tmp_path):
    """A 65-token prompt with 64 tokens loaded in the same step runs as a one-token step:
    its loaded KV must be read from the paged cache, not from a stale decode mirror. A
    corrupted block, found after the step used it, makes the request recompute."""
    host = make_plugin_manager(load_entrypoints=False)
    host.register_object(_SyncPlugin(), "sync")
    config = make_config(
        model=str(tiny_llama),
        dtype="float32",
        block_size=BLOCK,
        num_blocks_override=64,
        max_model_len=512,
        kv_transfer={"connector": "sync_storage", "extra_config": {"path": str(tmp_path)}},
    )
    rng = random.Random(9)
    prompt = [rng.randrange(10, 8000) for _ in range(65)]
    other = [rng.randrange(10, 8000) for _ in range(30)]
    from enginecore_kv_connectors.kv_blocks import prefix_keys

    runs = []
    for engine_run in range(2):
        engine = EngineCore(config, host)
        try:
            # "other" keeps decoding, so the decode mirror is live when "p" arrives.
            engine.add_request(engine_request("other", other, max_tokens=12))
            for _ in range(3):
                engine.step()
            runs.append(run_to_completion(engine, [engine_request("p", prompt, max_tokens=6)]))
            if engine_run == 1:
                # Again, from a corrupted file (and no local prefix cache).
                assert engine.reset_prefix_cache()
                [bad] = list(tmp_path.rglob(f"{prefix_keys(prompt, BLOCK)[1]}.kvblock"))
                raw = bytearray(bad.read_bytes())
                raw[-7] ^= 0x55
                bad.write_bytes(bytes(raw))
                runs.append(run_to_completion(engine, [engine_request("p", prompt, max_tokens=6)]))
            assert engine.scheduler.leak_report() == []
        finally:
            engine.shutdown()
    first, loaded, recomputed = runs
    assert loaded["p"]["num_cached_tokens"] == 64
    assert loaded["p"]["tokens"] == first["p"]["tokens"]
    assert loaded["stats"]["num_prompt_tokens_computed"] == 1
    # The step that used the bad block is dropped; the request recomputes all but block 0.
    assert recomputed["p"]["tokens"] == first["p"]["tokens"]
    assert recomputed["stats"]["num_prompt_tokens_computed"] == 1 + 65 - BLOCK
    assert loaded["stats"]["num_kv_loaded_tokens"] == 64


def test_zmq_p2p_fetches_once_per_request():
    """A decode request preempted after its fetch recomputes: the producer sent its
    blocks once and freed them."""
    from enginecore.request import Request
    from enginecore_kv_connectors.zmq_p2p import ZmqP2PScheduler

    config = make_config(
        model="x",
        block_size=BLOCK,
        kv_transfer={
            "connector": "zmq_p2p",
            "role": "kv_consumer",
            "extra_config": {"peers": ["127.0.0.1:1234"]},
        },
    )
    connector = ZmqP2PScheduler(config)
    handle = {
        "do_remote_prefill": True,
        "remote_host": "127.0.0.1",
        "remote_port": 1234,
        "remote_request_id": "p-1",
        "num_tokens": 64,
    }
    request = Request("d-1", list(range(70)), SamplingParams(kv_transfer_params=handle))
    assert connector.get_num_new_matched_tokens(request, 0) == (64, True)
    assert connector.get_num_new_matched_tokens(request, 16) == (48, True)
    connector.update_state_after_alloc(request, list(range(1, 6)), 64)
    [fetch] = connector.build_connector_meta(None).fetches
    assert (fetch.remote_request_id, fetch.first_block, fetch.block_ids) == ("p-1", 0, [1, 2, 3, 4])
    assert connector.get_num_new_matched_tokens(request, 0) == (0, False)  # after preemption
    assert connector.request_finished(request, [1, 2, 3, 4, 5]) == (False, None)
