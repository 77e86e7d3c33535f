"""The default scheduler with a KV connector that loads asynchronously: requests wait in
WAITING_FOR_REMOTE_KVS, resume with their loaded tokens, recompute invalid blocks, fail
alone, and are freed when aborted mid-load only once the load reports (vLLM's CPU
scheduler behaviours 36-37). The connector half here is scripted; the scheduler is real."""

from __future__ import annotations

from enginecore import make_config
from enginecore.interfaces import KVConnectorScheduler
from enginecore.request import FinishReason, RequestStatus
from enginecore.runner_output import KVConnectorOutput, ModelRunnerOutput
from enginecore_schedulers.policies import FCFSPolicy
from enginecore_schedulers.scheduler import DefaultScheduler
from tests.helpers.scheduler import make_output, make_request

BS = 4


class AsyncLoader(KVConnectorScheduler):
    """Offers every full prompt block after the local hit, loaded asynchronously."""

    def __init__(self) -> None:
        self.allocs: list[tuple[str, list[int], int]] = []
        self.outputs: list[KVConnectorOutput] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        external = (request.num_prompt_tokens - 1) // BS * BS - num_computed_tokens
        return (external, True) if external > 0 else (0, False)

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.allocs.append((request.request_id, list(block_ids), num_external_tokens))

    def build_connector_meta(self, scheduler_output):
        return None

    def request_finished(self, request, block_ids):
        return False, None

    def update_connector_output(self, output):
        self.outputs.append(output)


def _scheduler(prefix_caching: bool = True) -> tuple[DefaultScheduler, AsyncLoader]:
    connector = AsyncLoader()
    config = make_config(model="x", block_size=BS, prefix_caching=prefix_caching)
    scheduler = DefaultScheduler(
        config, num_blocks=40, max_model_len=64, policy=FCFSPolicy(config), kv_connector=connector
    )
    return scheduler, connector


def _report(scheduler: DefaultScheduler, **kv) -> dict:
    out = scheduler.schedule()
    runner = make_output(scheduler, out)
    runner.kv_connector_output = KVConnectorOutput(**kv)
    return scheduler.update_from_output(out, runner), out


def test_async_load_parks_then_computes_only_the_tail():
    scheduler, connector = _scheduler()
    scheduler.add_request(make_request("a", list(range(14)), max_tokens=2))
    out = scheduler.schedule()
    # Parked: holds blocks for the 12 loadable tokens, nothing scheduled.
    assert out.num_scheduled_tokens == {}
    assert scheduler.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert connector.allocs[0][2] == 12 and len(connector.allocs[0][1]) == 3
    assert scheduler.get_request_counts() == (0, 1)
    # Blocks being written are not findable by hash.
    assert scheduler.kv_cache_manager.block_pool.cached_blocks == {}
    scheduler.update_from_output(out, ModelRunnerOutput())
    for _ in range(2):  # still loading: it stays parked, the loop is not blocked
        out = scheduler.schedule()
        assert out.num_scheduled_tokens == {}
        scheduler.update_from_output(out, ModelRunnerOutput())
    out = scheduler.schedule()
    scheduler.update_from_output(
        out, ModelRunnerOutput(kv_connector_output=KVConnectorOutput(finished_recving={"a"}))
    )
    assert scheduler.requests["a"].status == RequestStatus.WAITING
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 2}  # 14 - 12 loaded
    assert out.scheduled_new_reqs[0].num_computed_tokens == 12
    assert len(scheduler.kv_cache_manager.block_pool.cached_blocks) == 3
    scheduler.update_from_output(out, make_output(scheduler, out))
    stats = scheduler.make_stats()
    assert stats.num_kv_loaded_tokens == 12 and stats.num_prompt_tokens_computed == 2


def test_invalid_blocks_are_recomputed_from_the_first_bad_one():
    scheduler, connector = _scheduler()
    scheduler.add_request(make_request("a", list(range(14)), max_tokens=1))
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput())
    block_ids = connector.allocs[0][1]
    # The report of a bad block may come a step before the load's end.
    _report(scheduler, invalid_block_ids={block_ids[1]})
    _report(scheduler, finished_recving={"a"})
    # Only block 0 holds trusted KV: only it becomes findable by hash.
    assert len(scheduler.kv_cache_manager.block_pool.cached_blocks) == 1
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 10}  # 14 - the 4 tokens of block 0
    scheduler.update_from_output(out, make_output(scheduler, out))
    _drain(scheduler)


def test_failed_transfer_fails_only_that_request():
    scheduler, _ = _scheduler()
    scheduler.add_request(make_request("a", list(range(14)), max_tokens=1))
    scheduler.add_request(make_request("b", [7] * 14, max_tokens=1, seq_no=1))
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput())
    outputs, _ = _report(scheduler, failures={"a": "disk on fire"}, finished_recving={"b"})
    [failed] = [o for batch in outputs.values() for o in batch.outputs if o.request_id == "a"]
    assert failed.finish_reason == FinishReason.ERROR
    assert "disk on fire" in failed.error
    assert "a" not in scheduler.requests and "b" in scheduler.requests
    _drain(scheduler)


def test_abort_while_loading_frees_blocks_when_the_load_reports():
    scheduler, _ = _scheduler(prefix_caching=False)
    scheduler.add_request(make_request("a", list(range(14)), max_tokens=1))
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput())
    free_before = scheduler.kv_cache_manager.get_num_free_blocks()
    [aborted] = scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert aborted.status == RequestStatus.FINISHED_ABORTED
    assert "a" not in scheduler.requests
    # The worker may still be writing into its blocks: they stay held.
    assert scheduler.kv_cache_manager.get_num_free_blocks() == free_before
    assert scheduler.has_requests()
    _report(scheduler, finished_recving={"a"})
    assert scheduler.kv_cache_manager.get_num_free_blocks() == free_before + 3
    _drain(scheduler)


def _drain(scheduler: DefaultScheduler) -> None:
    for _ in range(50):
        if not scheduler.has_requests():
            break
        out = scheduler.schedule()
        scheduler.update_from_output(out, make_output(scheduler, out))
    assert scheduler.leak_report() == []


class RaisingConnector(AsyncLoader):
    """Raises on requests whose id says so, in the call the id names (as a connector
    given a request's malformed ``kv_transfer_params`` would)."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.request_id.startswith("bad-match"):
            raise ValueError("invalid literal for int() with base 10: 'abc'")
        return 0, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        if request.request_id.startswith("bad-alloc"):
            raise KeyError("remote_host")
        super().update_state_after_alloc(request, block_ids, num_external_tokens)

    def request_finished(self, request, block_ids):
        if request.request_id.startswith("bad-finish"):
            raise RuntimeError("broken bookkeeping")
        return False, None


def test_a_connector_error_on_one_request_fails_that_request_only():
    connector = RaisingConnector()
    config = make_config(model="x", block_size=BS)
    scheduler = DefaultScheduler(
        config, num_blocks=40, max_model_len=64, policy=FCFSPolicy(config), kv_connector=connector
    )
    free_before = scheduler.kv_cache_manager.get_num_free_blocks()
    for rid in ("bad-match", "good-1", "bad-alloc", "bad-finish", "good-2"):
        scheduler.add_request(make_request(rid, list(range(10)), max_tokens=2))
    finished: dict[str, object] = {}
    for _ in range(10):
        out = scheduler.schedule()
        results = scheduler.update_from_output(out, make_output(scheduler, out))
        for outputs in results.values():
            for output in outputs.outputs:
                if output.finish_reason is not None:
                    finished[output.request_id] = output
        if not scheduler.has_requests():
            break
    assert set(finished) == {"bad-match", "good-1", "bad-alloc", "bad-finish", "good-2"}
    for rid in ("bad-match", "bad-alloc"):
        assert finished[rid].finish_reason == FinishReason.ERROR
        assert "KV connector" in finished[rid].error
    assert "abc" in finished["bad-match"].error and "remote_host" in finished["bad-alloc"].error
    for rid in ("good-1", "bad-finish", "good-2"):  # a failing request_finished loses nothing
        assert finished[rid].finish_reason == FinishReason.LENGTH, finished[rid]
    assert scheduler.kv_cache_manager.get_num_free_blocks() == free_before
