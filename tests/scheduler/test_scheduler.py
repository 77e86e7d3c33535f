"""The default scheduler, synchronously (reference statements 1-8, 10-21, 25-26, 32).

No model and no device: the runner output is built by hand. The autouse ``leak_check``
fixture aborts what a test leaves and checks that no request state and no KV block is
left behind.
"""

from __future__ import annotations

import msgspec
import pytest

from enginecore import make_config
from enginecore.interfaces import KVConnectorScheduler, SchedulerState
from enginecore.protocol import EngineCoreEventType
from enginecore.request import FinishReason, RequestStatus
from enginecore.runner_output import KVConnectorOutput, LogprobsLists, ModelRunnerOutput
from enginecore_schedulers.policies import FCFSPolicy
from enginecore_schedulers.scheduler import DefaultScheduler
from tests.helpers.scheduler import (
    EOS_TOKEN_ID,
    SAMPLED_TOKEN,
    assert_no_leaks,
    create_requests,
    create_scheduler,
    leak_check,  # noqa: F401  (autouse fixture)
    make_output,
    make_request,
    outputs_by_request,
    run_to_completion,
    step,
)


def waiting_ids(scheduler) -> list[str]:
    return [r.request_id for r in scheduler.waiting]


def running_ids(scheduler) -> list[str]:
    return [r.request_id for r in scheduler.running]


# --- construction --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("chunked", "given", "max_num_seqs", "expected"),
    [(True, None, 8, 2048), (False, None, 8, 4096), (True, 4, 8, 8), (True, 100, 8, 100)],
)
def test_token_budget_defaults(chunked, given, max_num_seqs, expected):
    config = make_config(
        model="x", chunked_prefill=chunked, max_num_batched_tokens=given, max_num_seqs=max_num_seqs
    )
    scheduler = DefaultScheduler(
        config, num_blocks=100, max_model_len=4096, policy=FCFSPolicy(config)
    )
    assert scheduler.max_num_batched_tokens == expected


# --- 1-9: scheduling basics ----------------------------------------------------------


def test_add_and_abort_waiting_request():
    scheduler = create_scheduler()
    requests = create_requests(3)
    for r in requests:
        scheduler.add_request(r)
    assert set(scheduler.requests) == {"0", "1", "2"}
    assert waiting_ids(scheduler) == ["0", "1", "2"]
    with pytest.raises(ValueError, match="already"):
        scheduler.add_request(requests[0])
    finished = scheduler.finish_requests("1", RequestStatus.FINISHED_ABORTED)
    assert finished == [requests[1]]
    assert requests[1].status == RequestStatus.FINISHED_ABORTED
    assert "1" not in scheduler.requests
    assert waiting_ids(scheduler) == ["0", "2"]
    # Idempotent: finishing again (or an unknown id) does nothing.
    assert scheduler.finish_requests(["1", "nope"], RequestStatus.FINISHED_ABORTED) == []
    out = scheduler.schedule()
    assert out.finished_req_ids == {"1"}
    assert [n.req_id for n in out.scheduled_new_reqs] == ["0", "2"]


def test_schedule_admits_all_waiting_requests():
    scheduler = create_scheduler()
    requests = create_requests(10)
    for r in requests:
        scheduler.add_request(r)
    out = scheduler.schedule()
    assert [n.req_id for n in out.scheduled_new_reqs] == [str(i) for i in range(10)]
    assert out.num_scheduled_tokens == {str(i): 10 for i in range(10)}
    assert out.total_num_scheduled_tokens == 100
    assert out.scheduled_cached_reqs.num_reqs == 0
    assert out.finished_req_ids == set()
    assert running_ids(scheduler) == [str(i) for i in range(10)]
    assert not scheduler.waiting
    assert all(r.status == RequestStatus.RUNNING for r in requests)
    new = out.scheduled_new_reqs[0]
    assert new.prompt_token_ids == [0] * 10
    assert new.num_computed_tokens == 0
    assert new.block_ids == scheduler.kv_cache_manager.get_block_ids("0")
    assert out.step_id == 1
    assert scheduler.schedule().step_id == 2


def test_decode_after_prefill_is_one_cached_token():
    scheduler = create_scheduler()
    [req] = create_requests(1, num_tokens=10)
    scheduler.add_request(req)
    step(scheduler)
    assert req.output_token_ids == [SAMPLED_TOKEN]
    out = scheduler.schedule()
    assert out.scheduled_new_reqs == []
    assert out.scheduled_cached_reqs.req_ids == ["0"]
    assert out.scheduled_cached_reqs.num_computed_tokens == [10]
    assert out.scheduled_cached_reqs.new_block_ids == [None]  # 11 tokens fit in block 1
    assert out.num_scheduled_tokens == {"0": 1}


def test_partial_prefill_chunk_samples_nothing_and_continues():
    scheduler = create_scheduler(max_num_batched_tokens=32, max_model_len=128)
    [req] = create_requests(1, num_tokens=50)
    scheduler.add_request(req)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"0": 32}
    runner = make_output(scheduler, out)
    assert runner.sampled_token_ids == [[]]
    assert scheduler.update_from_output(out, runner) == {}
    assert req.status == RequestStatus.RUNNING
    assert req.num_computed_tokens == 32 and req.output_token_ids == []
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"0": 18}
    assert out.scheduled_cached_reqs.req_ids == ["0"]
    assert out.scheduled_cached_reqs.new_block_ids == [
        [
            scheduler.kv_cache_manager.get_block_ids("0")[-2],
            scheduler.kv_cache_manager.get_block_ids("0")[-1],
        ]
    ]
    outs = outputs_by_request(scheduler.update_from_output(out, make_output(scheduler, out)))
    assert outs["0"].new_token_ids == [SAMPLED_TOKEN]


def test_budget_is_respected_and_running_requests_come_first():
    scheduler = create_scheduler(
        max_num_batched_tokens=1024, long_prefill_token_threshold=400, max_model_len=2048
    )
    for r in create_requests(3, num_tokens=800):
        scheduler.add_request(r)
    out = scheduler.schedule()
    assert [out.num_scheduled_tokens[i] for i in "012"] == [400, 400, 224]
    assert out.total_num_scheduled_tokens == 1024
    scheduler.update_from_output(out, make_output(scheduler, out))
    scheduler.add_request(make_request("late", [7] * 100, seq_no=10))
    out = scheduler.schedule()
    # Running requests first; the newcomer only gets what is left.
    assert [out.num_scheduled_tokens[i] for i in "012"] == [400, 400, 224]
    assert "late" not in out.num_scheduled_tokens
    for _ in range(20):
        out, _ = step(scheduler)
        assert out.total_num_scheduled_tokens <= 1024


def test_lone_long_prefill_is_not_capped_by_the_threshold():
    scheduler = create_scheduler(
        max_num_batched_tokens=1024, long_prefill_token_threshold=400, max_model_len=2048
    )
    scheduler.add_request(create_requests(1, num_tokens=800)[0])
    assert scheduler.schedule().num_scheduled_tokens == {"0": 800}


def test_without_chunked_prefill_a_request_that_does_not_fit_blocks_the_queue():
    scheduler = create_scheduler(chunked_prefill=False, max_num_batched_tokens=64, max_model_len=64)
    scheduler.add_request(make_request("a", [1] * 40, seq_no=0))
    scheduler.add_request(make_request("b", [2] * 30, seq_no=1))
    scheduler.add_request(make_request("c", [3] * 10, seq_no=2))
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"a": 40}  # c would fit, but b is ahead of it
    assert waiting_ids(scheduler) == ["b", "c"]
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 30, "c": 10}


def test_max_num_seqs_caps_running_requests():
    scheduler = create_scheduler(max_num_seqs=2)
    for r in create_requests(4):
        scheduler.add_request(r)
    out, _ = step(scheduler)
    assert list(out.num_scheduled_tokens) == ["0", "1"]
    assert waiting_ids(scheduler) == ["2", "3"]
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"0": 1, "1": 1}


# --- 10-15: stopping and outputs -----------------------------------------------------


def test_eos_finishes_with_stop_and_keeps_the_token():
    scheduler = create_scheduler()
    requests = create_requests(2)
    for r in requests:
        scheduler.add_request(r)
    _, eco = step(scheduler, {"0": [EOS_TOKEN_ID]})
    outs = outputs_by_request(eco)
    assert outs["0"].finish_reason == FinishReason.STOP
    assert outs["0"].new_token_ids == [EOS_TOKEN_ID]
    assert outs["1"].finish_reason is None
    assert requests[0].status == RequestStatus.FINISHED_STOPPED
    assert requests[0].output_token_ids == [EOS_TOKEN_ID]
    assert running_ids(scheduler) == ["1"]
    assert "0" not in scheduler.requests
    assert scheduler.schedule().finished_req_ids == {"0"}


def test_stop_token_sets_stop_reason_and_drops_later_tokens():
    scheduler = create_scheduler()
    [req] = create_requests(1, stop_token_ids=[42])
    scheduler.add_request(req)
    _, eco = step(scheduler, {"0": [7, 42, 9]})  # spec-decode style multi-token step
    o = outputs_by_request(eco)["0"]
    assert o.finish_reason == FinishReason.STOP and o.stop_reason == 42
    assert o.new_token_ids == [7, 42]
    assert req.output_token_ids == [7, 42]
    assert req.status == RequestStatus.FINISHED_STOPPED


def test_max_tokens_finishes_with_length():
    scheduler = create_scheduler()
    [req] = create_requests(1, max_tokens=3)
    scheduler.add_request(req)
    outs = [outputs_by_request(step(scheduler)[1])["0"] for _ in range(3)]
    assert [o.finish_reason for o in outs] == [None, None, FinishReason.LENGTH]
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert req.num_output_tokens == 3


def test_max_model_len_finishes_with_length_and_unset_max_tokens_is_resolved():
    scheduler = create_scheduler(max_model_len=20)
    req = make_request("a", [1] * 15, max_tokens=None)
    scheduler.add_request(req)
    assert req.max_tokens == 5  # max_model_len - prompt_len
    outs = run_to_completion(scheduler)
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert req.num_tokens == 20
    assert sum(o.total_num_scheduled_tokens for o in outs) == 19  # the last token is never computed


def test_min_tokens_and_ignore_eos():
    scheduler = create_scheduler(max_model_len=30)
    eos_early = make_request("eos", [1] * 10, max_tokens=10, min_tokens=5, seq_no=0)
    plain = make_request("plain", [2] * 10, max_tokens=10, min_tokens=5, seq_no=1)
    stop_early = make_request(
        "stop", [3] * 10, max_tokens=10, min_tokens=5, stop_token_ids=[9], seq_no=2
    )
    ignore = make_request("ignore", [4] * 10, max_tokens=2, ignore_eos=True, seq_no=3)
    capped = make_request("capped", [5] * 28, max_tokens=None, min_tokens=0, seq_no=4)
    for r in (eos_early, plain, stop_early, ignore, capped):
        scheduler.add_request(r)
    _, eco = step(scheduler, {"eos": [EOS_TOKEN_ID], "stop": [9], "ignore": [EOS_TOKEN_ID]})
    outs = outputs_by_request(eco)
    # EOS and stop tokens win below min_tokens; plain tokens do not finish anything.
    assert outs["eos"].finish_reason == FinishReason.STOP
    assert outs["stop"].finish_reason == FinishReason.STOP
    assert outs["plain"].finish_reason is None
    assert outs["ignore"].finish_reason is None  # ignore_eos
    assert outs["capped"].finish_reason is None
    _, eco = step(scheduler, {"ignore": [EOS_TOKEN_ID]})
    outs = outputs_by_request(eco)
    assert outs["ignore"].finish_reason == FinishReason.LENGTH
    assert outs["capped"].finish_reason == FinishReason.LENGTH  # max_model_len reached
    assert capped.num_tokens == 30


def test_outputs_for_a_request_aborted_meanwhile_are_ignored():
    scheduler = create_scheduler()
    requests = create_requests(2)
    for r in requests:
        scheduler.add_request(r)
    out = scheduler.schedule()
    runner = make_output(scheduler, out)
    scheduler.finish_requests("0", RequestStatus.FINISHED_ABORTED)
    eco = outputs_by_request(scheduler.update_from_output(out, runner))
    assert set(eco) == {"1"}
    assert requests[0].output_token_ids == []
    assert requests[0].status == RequestStatus.FINISHED_ABORTED


def test_outputs_are_grouped_by_client_and_carry_logprobs_events_and_cache_hits():
    scheduler = create_scheduler(prefix_caching=True)
    a = make_request("a", list(range(40)), seq_no=0, client_index=0, logprobs=1)
    b = make_request("b", list(range(40)), seq_no=1, client_index=1)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 40, "b": 8}  # b shares a's two full blocks
    runner = make_output(scheduler, out)
    runner.logprobs = LogprobsLists(
        logprob_token_ids=[[SAMPLED_TOKEN, 5], [SAMPLED_TOKEN, 6]],
        logprobs=[[-0.1, -2.5], [-0.2, -3.0]],
        sampled_token_ranks=[1, 1],
    )
    eco = scheduler.update_from_output(out, runner)
    assert set(eco) == {0, 1}
    [oa] = eco[0].outputs
    [ob] = eco[1].outputs
    assert oa.new_logprob_token_ids == [[SAMPLED_TOKEN, 5]]
    assert oa.new_logprobs == [[-0.1, -2.5]] and oa.new_sampled_ranks == [1]
    assert ob.new_logprobs is None  # b did not ask for logprobs
    assert oa.num_cached_tokens == 0 and ob.num_cached_tokens == 32
    assert [e[0] for e in oa.events] == [EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED]
    _, eco = step(scheduler)
    assert eco[0].outputs[0].events is None  # events are sent once


# --- 16-20: preemption and priority --------------------------------------------------


def test_preemption_picks_the_latest_fcfs_request_and_requeues_it_at_the_front():
    scheduler = create_scheduler(block_size=4, num_blocks=5, max_num_seqs=2)  # 4 usable blocks
    a = make_request("a", [1] * 8, seq_no=0, max_tokens=4)  # full: needs a 3rd block
    b = make_request("b", [2] * 6, seq_no=1, max_tokens=4)  # room for 2 more tokens
    c = make_request("c", [3] * 3, seq_no=2, max_tokens=4)
    for r in (a, b, c):
        scheduler.add_request(r)
    step(scheduler)
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 0
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.preempted_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert b.output_token_ids == [SAMPLED_TOKEN]
    assert scheduler.kv_cache_manager.get_block_ids("b") == []
    assert waiting_ids(scheduler) == ["b", "c"]  # front of the queue
    assert running_ids(scheduler) == ["a"]
    assert scheduler.make_stats().num_preemptions == 1
    scheduler.update_from_output(out, make_output(scheduler, out))
    run_to_completion(scheduler)
    # Resumed as a new request with its earlier output, then finished normally.
    assert b.num_output_tokens == 4 and b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert c.num_output_tokens == 4


def test_preempting_a_decode_already_scheduled_this_step_takes_its_row_back():
    # b runs ahead of a and is decoded on the fast path; then a needs a block, none is
    # free, and b (the latest arrival) is the victim: its row and counters are undone.
    scheduler = create_scheduler(block_size=4, num_blocks=5, max_num_seqs=2)  # 4 usable blocks
    a = make_request("a", [1] * 8, seq_no=0, max_tokens=4)
    b = make_request("b", [2] * 5, seq_no=1, max_tokens=4)
    scheduler.add_request(b)
    step(scheduler)
    scheduler.add_request(a)
    step(scheduler)
    assert running_ids(scheduler) == ["b", "a"]
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 0
    fast_before = scheduler.num_fast_decodes
    out = scheduler.schedule()
    assert scheduler.num_fast_decodes == fast_before + 1  # b took the fast path first
    assert out.preempted_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.scheduled_cached_reqs.req_ids == ["a"]
    assert out.scheduled_cached_reqs.num_computed_tokens == [8]
    assert out.scheduled_cached_reqs.new_block_ids is not None
    assert len(out.scheduled_cached_reqs.new_block_ids) == 1
    assert b.num_computed_tokens == 0 and b.num_output_placeholders == 0
    assert a.num_computed_tokens == 9 and a.num_output_placeholders == 1
    scheduler.update_from_output(out, make_output(scheduler, out))
    run_to_completion(scheduler)
    assert a.num_output_tokens == 4 and b.num_output_tokens == 4
    assert b.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_resumed_request_comes_back_as_new_with_its_outputs():
    scheduler = create_scheduler(block_size=4, num_blocks=5, max_num_seqs=2)
    a = make_request("a", [1] * 8, seq_no=0, max_tokens=2)
    b = make_request("b", [2] * 6, seq_no=1)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)
    out, _ = step(scheduler)  # b preempted; a finishes (max_tokens=2)
    assert out.preempted_req_ids == {"b"}
    assert a.is_finished
    out = scheduler.schedule()
    assert out.finished_req_ids == {"a"}
    [new] = out.scheduled_new_reqs
    assert new.req_id == "b"
    assert new.output_token_ids == [SAMPLED_TOKEN]
    assert new.num_computed_tokens == 0
    assert out.num_scheduled_tokens == {"b": 7}  # prompt + earlier output, recomputed
    assert out.preempted_req_ids == set()


def test_no_admission_in_a_step_that_preempted():
    scheduler = create_scheduler(block_size=4, num_blocks=5, max_num_seqs=3, policy="priority")
    a = make_request("a", [1] * 8, seq_no=0, priority=0)
    b = make_request("b", [2] * 6, seq_no=1, priority=1)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)
    c = make_request("c", [3] * 3, seq_no=2, priority=0)  # would fit in the freed blocks
    scheduler.add_request(c)
    out, _ = step(scheduler)
    assert out.preempted_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1}
    assert waiting_ids(scheduler) == ["c", "b"]  # priority order: c before b
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "c": 3}


def test_request_that_is_its_own_victim_is_not_scheduled():
    scheduler = create_scheduler(block_size=4, num_blocks=5)
    a = make_request("a", [1] * 6, seq_no=0)  # room for 2 more tokens
    b = make_request("b", [2] * 8, seq_no=1)  # full: needs a new block
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)
    out = scheduler.schedule()
    assert out.preempted_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED


def test_priority_preempts_lowest_priority_even_if_already_scheduled():
    scheduler = create_scheduler(block_size=4, num_blocks=5, policy="priority")  # 4 usable
    low = make_request("low", [1] * 5, seq_no=0, priority=5)  # 2 blocks, admitted alone
    scheduler.add_request(low)
    step(scheduler)
    high = make_request("high", [2] * 3, seq_no=1, priority=0)  # 1 block
    scheduler.add_request(high)
    step(scheduler)
    mid = make_request("mid", [3] * 2, seq_no=2, priority=1)  # the last block
    scheduler.add_request(mid)
    step(scheduler)
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 0
    assert running_ids(scheduler) == ["low", "high", "mid"]
    # low still fits and is scheduled first; high then needs a block: the victim is low
    # (lowest priority), already scheduled this step, so its tokens are taken back.
    out = scheduler.schedule()
    assert out.preempted_req_ids == {"low"}
    assert out.num_scheduled_tokens == {"high": 1, "mid": 1}
    assert out.total_num_scheduled_tokens == 2
    assert out.scheduled_cached_reqs.req_ids == ["high", "mid"]
    assert len(out.scheduled_cached_reqs.new_block_ids) == 2
    assert low.status == RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    assert low.num_output_placeholders == 0


def test_priority_admission_order_and_no_preemption_with_enough_blocks():
    scheduler = create_scheduler(policy="priority", max_num_seqs=2)
    for rid, seq, prio in [("a", 0, 3), ("b", 1, 1), ("c", 2, 1), ("d", 3, 0)]:
        scheduler.add_request(make_request(rid, [seq] * 10, seq_no=seq, priority=prio))
    out, _ = step(scheduler)
    assert [n.req_id for n in out.scheduled_new_reqs] == ["d", "b"]
    assert waiting_ids(scheduler) == ["c", "a"]
    outs = run_to_completion(scheduler)
    assert all(not o.preempted_req_ids for o in outs)


def _encoded_run(policy: str) -> list[bytes]:
    scheduler = create_scheduler(
        policy=policy,
        block_size=4,
        num_blocks=16,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        prefix_caching=True,
    )
    for r in create_requests(8, num_tokens=13, max_tokens=9):
        scheduler.add_request(r)
    outs = run_to_completion(scheduler)
    assert any(o.preempted_req_ids for o in outs)  # the run exercises preemption
    return [msgspec.msgpack.encode(o) for o in outs]


def test_equal_priorities_behave_like_fcfs():
    assert _encoded_run("priority") == _encoded_run("fcfs")


def test_identical_schedulers_make_identical_decisions():
    assert _encoded_run("fcfs") == _encoded_run("fcfs")


# --- 21, 25, 26, 32: prefix caching at the scheduler level --------------------------


def test_run_to_completion_with_prefix_caching_leaves_nothing_behind():
    scheduler = create_scheduler(prefix_caching=True, block_size=4, num_blocks=40)
    for r in create_requests(6, num_tokens=11, same_prompt=True):
        scheduler.add_request(r)
    run_to_completion(scheduler)
    assert_no_leaks(scheduler)
    assert scheduler.kv_cache_manager.block_pool.cached_blocks  # hashes survive (lazy)


@pytest.mark.parametrize("hash_algo", ["sha256", "builtin"])
def test_identical_prompts_in_one_step_share_blocks(hash_algo):
    scheduler = create_scheduler(prefix_caching=True, hash_algo=hash_algo)
    for r in create_requests(2, num_tokens=40, same_prompt=True):
        scheduler.add_request(r)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"0": 40, "1": 40 % 16}
    kv = scheduler.kv_cache_manager
    assert kv.get_block_ids("0")[:2] == kv.get_block_ids("1")[:2]
    assert out.scheduled_new_reqs[1].num_computed_tokens == 32
    assert scheduler.requests["1"].num_cached_tokens == 32


def test_multi_turn_prompt_hits_the_previous_turn():
    scheduler = create_scheduler(prefix_caching=True, block_size=4)
    first = make_request("t1", list(range(10)), max_tokens=6)
    scheduler.add_request(first)
    run_to_completion(scheduler)
    history = first.prompt_token_ids + first.output_token_ids  # 16 tokens
    second = make_request("t2", [*history, 77, 78], seq_no=1)
    scheduler.add_request(second)
    out = scheduler.schedule()
    # The last sampled token was never computed, so 15 known-KV tokens: 3 full blocks.
    assert out.scheduled_new_reqs[0].num_computed_tokens == 12
    assert out.num_scheduled_tokens == {"t2": 6}
    stats = scheduler.make_stats()
    assert stats.prefix_cache_hits == 12 and stats.prefix_cache_queries == 10 + 18


def test_reset_prefix_cache_at_the_scheduler_level():
    scheduler = create_scheduler(prefix_caching=True, block_size=4)
    for r in create_requests(2, num_tokens=9):
        scheduler.add_request(r)
    step(scheduler)
    assert not scheduler.reset_prefix_cache()
    assert scheduler.kv_cache_manager.block_pool.cached_blocks
    assert scheduler.reset_prefix_cache(reset_running_requests=True)
    assert scheduler.kv_cache_manager.block_pool.cached_blocks == {}
    assert running_ids(scheduler) == []
    assert waiting_ids(scheduler) == ["0", "1"]
    out = scheduler.schedule()
    assert out.preempted_req_ids == {"0", "1"}
    assert [n.req_id for n in out.scheduled_new_reqs] == ["0", "1"]
    assert out.num_scheduled_tokens == {"0": 10, "1": 10}  # nothing cached any more
    scheduler.update_from_output(out, make_output(scheduler, out))
    run_to_completion(scheduler)
    assert scheduler.reset_prefix_cache()


def test_make_stats_reports_counts_and_usage():
    scheduler = create_scheduler(max_num_seqs=1, block_size=4, num_blocks=11)
    for r in create_requests(2, num_tokens=8):
        scheduler.add_request(r)
    scheduler.schedule()
    stats = scheduler.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1)
    assert stats.kv_cache_usage == pytest.approx(0.2)  # 2 of 10 usable blocks
    assert stats.num_scheduled_tokens == 8 and stats.step_counter == 1
    assert scheduler.get_request_counts() == (1, 1)
    assert scheduler.get_num_unfinished_requests() == 2
    quiet = create_scheduler(log_stats=False)
    assert quiet.make_stats() is None


def test_abort_everything_frees_all_blocks():
    scheduler = create_scheduler(block_size=4, num_blocks=20, max_num_seqs=3)
    for r in create_requests(5, num_tokens=9):
        scheduler.add_request(r)
    step(scheduler)
    step(scheduler)
    finished = scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    assert sorted(r.request_id for r in finished) == ["0", "1", "2", "3", "4"]
    assert not scheduler.has_unfinished_requests()
    assert scheduler.has_finished_requests()
    out = scheduler.schedule()
    assert out.finished_req_ids == {"0", "1", "2", "3", "4"}
    assert out.total_num_scheduled_tokens == 0
    assert not scheduler.has_requests()
    with pytest.raises(ValueError):
        scheduler.finish_requests(None, RequestStatus.RUNNING)


def test_unknown_runner_rows_are_ignored():
    scheduler = create_scheduler()
    scheduler.add_request(create_requests(1)[0])
    out = scheduler.schedule()
    runner = ModelRunnerOutput(
        req_ids=["ghost", "0"],
        req_id_to_index={"ghost": 0, "0": 1},
        sampled_token_ids=[[1], [2]],
    )
    eco = outputs_by_request(scheduler.update_from_output(out, runner))
    assert set(eco) == {"0"} and eco["0"].new_token_ids == [2]


class _FakeConnector(KVConnectorScheduler):
    """Offers ``external`` extra tokens for every request; may hold blocks while saving."""

    def __init__(self, external: int, delay_free: bool) -> None:
        self.external = external
        self.delay_free = delay_free
        self.allocs: list[tuple[str, int, int]] = []
        self.metas = 0
        self.finished: list[str] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.external, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.allocs.append((request.request_id, len(block_ids), num_external_tokens))

    def build_connector_meta(self, scheduler_output):
        self.metas += 1
        return {"step": scheduler_output.step_id}

    def request_finished(self, request, block_ids):
        self.finished.append(request.request_id)
        return self.delay_free, {"remote_blocks": list(block_ids)}


def test_kv_connector_external_hits_and_delayed_free():
    connector = _FakeConnector(external=8, delay_free=True)
    config = make_config(model="x", block_size=4, prefix_caching=False)
    scheduler = DefaultScheduler(
        config, num_blocks=20, max_model_len=64, policy=FCFSPolicy(config), kv_connector=connector
    )
    scheduler.add_request(make_request("a", [1] * 10, max_tokens=1))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 2}  # 10 - 8 external tokens
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8
    assert out.kv_connector_metadata == {"step": 1}
    assert connector.allocs == [("a", 3, 8)]
    eco = outputs_by_request(scheduler.update_from_output(out, make_output(scheduler, out)))
    assert eco["a"].finish_reason == FinishReason.LENGTH
    assert eco["a"].kv_transfer_params == {"remote_blocks": [1, 2, 3]}
    assert connector.finished == ["a"]
    # Blocks stay held until the worker reports the save finished.
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 16
    assert scheduler.leak_report()
    out = scheduler.schedule()
    scheduler.update_from_output(
        out, ModelRunnerOutput(kv_connector_output=KVConnectorOutput(finished_sending={"a"}))
    )
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 19
    assert connector.metas == 2


class _NoSecondRunner(FCFSPolicy):
    """Admits at most one running request, and only those whose id is not "skip"."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.states: list[SchedulerState] = []

    def admit(self, request, state):
        self.states.append(state)
        return request.request_id != "skip" and state.num_running < 2


def test_policy_admit_is_consulted_with_the_scheduler_state():
    config = make_config(model="x", block_size=4, max_num_batched_tokens=100, max_num_seqs=4)
    policy = _NoSecondRunner(config)
    scheduler = DefaultScheduler(config, num_blocks=11, max_model_len=100, policy=policy)
    for rid, seq in [("skip", 0), ("a", 1), ("b", 2), ("c", 3)]:
        scheduler.add_request(make_request(rid, [seq] * 6, seq_no=seq))
    out = scheduler.schedule()
    # "skip" is passed over (and stays first in line); a and b are admitted; c is refused.
    assert list(out.num_scheduled_tokens) == ["a", "b"]
    assert waiting_ids(scheduler) == ["skip", "c"]
    first = policy.states[0]
    assert (first.num_running, first.num_waiting, first.num_free_blocks) == (0, 4, 10)
    assert first.num_total_blocks == 10 and first.token_budget_left == 100 and first.step == 1
    assert policy.states[2].token_budget_left == 94 and policy.states[2].num_free_blocks == 8
    scheduler.update_from_output(out, make_output(scheduler, out))


def test_prompt_longer_than_max_model_len_is_refused():
    scheduler = create_scheduler(max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request(make_request("long", [1] * 9))
    assert not scheduler.has_requests()
