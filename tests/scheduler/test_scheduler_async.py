"""Async scheduling: step N+1 is scheduled before step N's tokens are known
(reference statements 9, 19, 33, 34).

The engine keeps up to two batches in flight; the scheduler uses output placeholders.
"""

from __future__ import annotations

import msgspec

from enginecore.request import FinishReason, RequestStatus
from tests.helpers.scheduler import (
    EOS_TOKEN_ID,
    SAMPLED_TOKEN,
    create_requests,
    create_scheduler,
    leak_check,  # noqa: F401  (autouse fixture)
    make_output,
    make_request,
    outputs_by_request,
    run_async,
)


def test_two_batches_in_flight_use_placeholders():
    scheduler = create_scheduler()
    requests = create_requests(2, num_tokens=10)
    for r in requests:
        scheduler.add_request(r)
    out1 = scheduler.schedule()
    out2 = scheduler.schedule()  # legal: out1's tokens are not known yet
    assert out1.num_scheduled_tokens == {"0": 10, "1": 10}
    assert out2.num_scheduled_tokens == {"0": 1, "1": 1}
    assert out2.scheduled_cached_reqs.req_ids == ["0", "1"]
    assert out2.scheduled_cached_reqs.num_computed_tokens == [10, 10]
    assert all(r.num_output_placeholders == 2 and r.num_computed_tokens == 11 for r in requests)
    eco = outputs_by_request(scheduler.update_from_output(out1, make_output(scheduler, out1)))
    assert eco["0"].new_token_ids == [SAMPLED_TOKEN]
    assert all(r.num_output_placeholders == 1 and r.num_tokens == 11 for r in requests)
    out3 = scheduler.schedule()
    assert out3.num_scheduled_tokens == {"0": 1, "1": 1}
    scheduler.update_from_output(out2, make_output(scheduler, out2))
    scheduler.update_from_output(out3, make_output(scheduler, out3))
    assert all(r.num_output_placeholders == 0 and r.num_output_tokens == 3 for r in requests)


def test_partial_prefill_adds_no_placeholder():
    scheduler = create_scheduler(max_num_batched_tokens=32, max_model_len=128)
    [req] = create_requests(1, num_tokens=50)
    scheduler.add_request(req)
    out1 = scheduler.schedule()
    assert req.num_output_placeholders == 0
    out2 = scheduler.schedule()
    assert out2.num_scheduled_tokens == {"0": 18}
    assert req.num_output_placeholders == 1
    out3 = scheduler.schedule()
    assert out3.num_scheduled_tokens == {"0": 1}
    for out in (out1, out2, out3):
        scheduler.update_from_output(out, make_output(scheduler, out))
    assert req.output_token_ids == [SAMPLED_TOKEN, SAMPLED_TOKEN]


def test_never_schedules_past_prompt_plus_max_tokens_minus_one():
    scheduler = create_scheduler(max_num_batched_tokens=64, max_model_len=256, block_size=4)
    max_tokens = {"0": 1, "1": 2, "2": 3, "3": 7, "4": 16}
    for i, (rid, mt) in enumerate(max_tokens.items()):
        scheduler.add_request(make_request(rid, [i] * (5 + 9 * i), max_tokens=mt, seq_no=i))
    prompt_len = {r: scheduler.requests[r].num_prompt_tokens for r in max_tokens}
    scheduled = dict.fromkeys(max_tokens, 0)
    received = {r: [] for r in max_tokens}
    finish = {}
    for out, eco in run_async(scheduler, depth=2):
        for rid, n in out.num_scheduled_tokens.items():
            scheduled[rid] += n
            assert scheduled[rid] <= prompt_len[rid] + max_tokens[rid] - 1
        for rid, o in outputs_by_request(eco).items():
            received[rid] += o.new_token_ids
            if o.finished:
                finish[rid] = o.finish_reason
    for rid, mt in max_tokens.items():
        assert len(received[rid]) == mt
        assert scheduled[rid] == prompt_len[rid] + mt - 1
        assert finish[rid] == FinishReason.LENGTH


def test_abort_with_two_batches_in_flight_keeps_only_earlier_outputs():
    scheduler = create_scheduler()
    requests = create_requests(3, num_tokens=10)
    for r in requests:
        scheduler.add_request(r)
    out1 = scheduler.schedule()
    out2 = scheduler.schedule()
    run1, run2 = make_output(scheduler, out1), make_output(scheduler, out2)
    scheduler.finish_requests("0", RequestStatus.FINISHED_ABORTED)
    eco1 = outputs_by_request(scheduler.update_from_output(out1, run1))
    scheduler.finish_requests(["1"], RequestStatus.FINISHED_ABORTED)
    eco2 = outputs_by_request(scheduler.update_from_output(out2, run2))
    assert "0" not in eco1 and "0" not in eco2
    assert eco1["1"].new_token_ids == [SAMPLED_TOKEN] and "1" not in eco2
    assert requests[0].output_token_ids == []
    assert requests[1].output_token_ids == [SAMPLED_TOKEN]
    assert requests[2].output_token_ids == [SAMPLED_TOKEN] * 2
    assert requests[0].status == requests[1].status == RequestStatus.FINISHED_ABORTED
    out3 = scheduler.schedule()
    assert out3.finished_req_ids == {"0", "1"}
    assert out3.num_scheduled_tokens == {"2": 1}
    scheduler.update_from_output(out3, make_output(scheduler, out3))


def test_output_after_a_stop_is_dropped():
    scheduler = create_scheduler()
    [req] = create_requests(1, num_tokens=10, max_tokens=10)
    scheduler.add_request(req)
    out1 = scheduler.schedule()
    out2 = scheduler.schedule()
    eco1 = outputs_by_request(
        scheduler.update_from_output(out1, make_output(scheduler, out1, {"0": [EOS_TOKEN_ID]}))
    )
    assert eco1["0"].finish_reason == FinishReason.STOP
    assert scheduler.update_from_output(out2, make_output(scheduler, out2)) == {}
    assert req.output_token_ids == [EOS_TOKEN_ID]


def test_output_for_a_request_preempted_after_launch_is_applied():
    scheduler = create_scheduler(block_size=4, num_blocks=5)  # 4 usable blocks
    a = make_request("a", [1] * 6, seq_no=0, max_tokens=2)
    b = make_request("b", [2] * 8, seq_no=1, max_tokens=3)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out1 = scheduler.schedule()
    run1 = make_output(scheduler, out1)
    out2 = scheduler.schedule()  # b needs a third block: it is the victim
    assert out2.preempted_req_ids == {"b"}
    assert out2.num_scheduled_tokens == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and b.num_output_placeholders == 1
    eco = outputs_by_request(scheduler.update_from_output(out1, run1))
    assert eco["b"].new_token_ids == [SAMPLED_TOKEN]  # applied although preempted
    assert b.output_token_ids == [SAMPLED_TOKEN] and b.num_output_placeholders == 0
    assert b.status == RequestStatus.PREEMPTED
    received = {"a": [SAMPLED_TOKEN], "b": [SAMPLED_TOKEN]}
    in_flight = [(out2, make_output(scheduler, out2))]
    while scheduler.has_requests() or in_flight:
        if scheduler.has_requests():
            out = scheduler.schedule()
            in_flight.append((out, make_output(scheduler, out)))
        out, run = in_flight.pop(0)
        for rid, o in outputs_by_request(scheduler.update_from_output(out, run)).items():
            received[rid] += o.new_token_ids
    assert len(received["a"]) == 2 and len(received["b"]) == 3
    assert b.num_preemptions == 1 and b.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_preempted_request_resumes_only_after_its_in_flight_output():
    scheduler = create_scheduler(block_size=4, prefix_caching=True)
    requests = create_requests(2, num_tokens=9, max_tokens=4)
    for r in requests:
        scheduler.add_request(r)
    out1 = scheduler.schedule()
    out2 = scheduler.schedule()
    assert scheduler.reset_prefix_cache(reset_running_requests=True)
    out3 = scheduler.schedule()
    # Plenty of blocks, but both still have a token in flight: not resumed yet.
    assert out3.preempted_req_ids == {"0", "1"}
    assert out3.total_num_scheduled_tokens == 0
    scheduler.update_from_output(out1, make_output(scheduler, out1))
    scheduler.update_from_output(out2, make_output(scheduler, out2))
    assert all(r.num_output_tokens == 2 and r.num_output_placeholders == 0 for r in requests)
    out4 = scheduler.schedule()
    assert [n.req_id for n in out4.scheduled_new_reqs] == ["0", "1"]
    assert [n.output_token_ids for n in out4.scheduled_new_reqs] == [[SAMPLED_TOKEN] * 2] * 2
    assert out4.num_scheduled_tokens == {"0": 11, "1": 11}  # the cache was reset
    scheduler.update_from_output(out4, make_output(scheduler, out4))
    for _ in run_async(scheduler):
        pass
    assert all(r.num_output_tokens == 4 for r in requests)


def _async_trace() -> list[bytes]:
    scheduler = create_scheduler(
        block_size=4, num_blocks=16, max_num_seqs=4, max_num_batched_tokens=32, prefix_caching=True
    )
    for r in create_requests(8, num_tokens=13, max_tokens=9, same_prompt=True):
        scheduler.add_request(r)
    return [msgspec.msgpack.encode(out) for out, _ in run_async(scheduler)]


def test_async_runs_are_deterministic():
    first = _async_trace()
    assert len(first) > 8
    assert first == _async_trace()


def test_async_finished_requests_populate_the_prefix_cache():
    scheduler = create_scheduler(block_size=4, prefix_caching=True)
    first = make_request("t1", list(range(10)), max_tokens=7)
    scheduler.add_request(first)
    for _ in run_async(scheduler):
        pass
    history = first.prompt_token_ids + first.output_token_ids  # 17 tokens, 16 computed
    second = make_request("t2", [*history, 5], seq_no=1)
    scheduler.add_request(second)
    out = scheduler.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 16
    scheduler.update_from_output(out, make_output(scheduler, out))


def test_in_flight_eos_finishes_a_preempted_request_and_leaves_the_queue():
    scheduler = create_scheduler(block_size=4, num_blocks=5)
    a = make_request("a", [1] * 6, seq_no=0, max_tokens=2)
    b = make_request("b", [2] * 8, seq_no=1, max_tokens=3)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out1 = scheduler.schedule()
    run1 = make_output(scheduler, out1, {"b": [EOS_TOKEN_ID]})
    out2 = scheduler.schedule()
    assert out2.preempted_req_ids == {"b"} and [r.request_id for r in scheduler.waiting] == ["b"]
    eco = outputs_by_request(scheduler.update_from_output(out1, run1))
    assert eco["b"].finish_reason == FinishReason.STOP
    assert b.status == RequestStatus.FINISHED_STOPPED
    assert not scheduler.waiting and "b" not in scheduler.requests
    scheduler.update_from_output(out2, make_output(scheduler, out2))
    assert a.is_finished and scheduler.schedule().finished_req_ids == {"a", "b"}
