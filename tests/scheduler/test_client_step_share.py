"""One client's flood against another client's short request, counted in scheduler steps.

A client holding many long requests must not make every step slow for a client holding
one: while more than one client has unfinished requests, at most
``max_num_seqs_per_client`` requests of one client run in a step (the rest take turns),
and a new client's request is admitted ahead of the flooder's queued work, whatever the
policy. Driven on the real scheduler with hand-built runner outputs (no model).
"""

from __future__ import annotations

import pytest

from enginecore import make_config
from enginecore.request import RequestStatus
from enginecore_schedulers.policies import FairSharePolicy, FCFSPolicy, PriorityPolicy
from enginecore_schedulers.scheduler import SHARE_HOLD_STEPS, DefaultScheduler
from tests.helpers.scheduler import assert_no_leaks, make_request, step

CAP = 8
FLOOD = 64


def _scheduler(policy=FCFSPolicy, cap: int = CAP, max_num_seqs: int = 256) -> DefaultScheduler:
    config = make_config(
        model="fake",
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=8192,
        max_num_seqs_per_client=cap,
    )
    return DefaultScheduler(config, num_blocks=20_000, max_model_len=8192, policy=policy(config))


def _request(request_id: str, seq_no: int, client: str | None, max_tokens: int):
    extra = {"client": client} if client is not None else None
    return make_request(request_id, [7] * 12, max_tokens=max_tokens, seq_no=seq_no, extra=extra)


def _flood(scheduler: DefaultScheduler, count: int, client: str | None = "127.0.0.1") -> None:
    for i in range(count):
        scheduler.add_request(_request(f"flood-{i}", i, client, max_tokens=400))


def _finish(scheduler: DefaultScheduler) -> None:
    scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    assert_no_leaks(scheduler)


def _per_step(out, prefix: str) -> int:
    return sum(1 for r in out.num_scheduled_tokens if r.startswith(prefix))


@pytest.mark.parametrize("policy", [FCFSPolicy, PriorityPolicy, FairSharePolicy])
def test_another_clients_request_runs_in_small_steps_while_a_flood_runs(policy):
    scheduler = _scheduler(policy)
    _flood(scheduler, FLOOD)
    for _ in range(3):  # alone, the flood fills every step
        out, _ = step(scheduler)
        assert _per_step(out, "flood-") == FLOOD
    arrival = scheduler.make_stats().step_counter
    scheduler.add_request(_request("other", FLOOD, "127.0.0.2", max_tokens=4))
    steps_with_other = []
    while "other" in scheduler.requests:
        out, _ = step(scheduler)
        if "other" in out.num_scheduled_tokens:
            steps_with_other.append(out.step_id - arrival)
        assert _per_step(out, "flood-") <= CAP
        assert out.step_id - arrival <= 10, "the other client's request did not finish"
    # Scheduled in the first step after it arrived, and in every step until it finished.
    assert steps_with_other == [1, 2, 3, 4]
    # The cap holds a while (the client may send its next request at once), then the
    # flood, alone again, fills the step once more.
    sizes = [_per_step(step(scheduler)[0], "flood-") for _ in range(SHARE_HOLD_STEPS + 1)]
    assert sizes == [CAP] * SHARE_HOLD_STEPS + [FLOOD]
    _finish(scheduler)


def test_a_client_sending_one_request_after_another_never_meets_a_full_step():
    scheduler = _scheduler()
    _flood(scheduler, FLOOD)
    step(scheduler)
    for turn in range(3):
        scheduler.add_request(_request(f"other-{turn}", FLOOD + turn, "127.0.0.2", 4))
        while f"other-{turn}" in scheduler.requests:
            assert _per_step(step(scheduler)[0], "flood-") <= CAP
        step(scheduler)  # its reply travels back; the next request comes in
    _finish(scheduler)


def test_the_capped_client_takes_turns():
    scheduler = _scheduler()
    _flood(scheduler, FLOOD)
    step(scheduler)  # every flood request's prefill
    scheduler.add_request(_request("other", FLOOD, "127.0.0.2", max_tokens=400))
    ran: dict[str, int] = {}
    rounds = FLOOD // CAP
    for _ in range(rounds):
        out, _ = step(scheduler)
        for request_id in out.num_scheduled_tokens:
            ran[request_id] = ran.get(request_id, 0) + 1
    assert ran.pop("other") == rounds
    # Each of the flood's requests ran once in FLOOD / CAP steps: none starves.
    assert sorted(ran.values()) == [1] * FLOOD
    _finish(scheduler)


@pytest.mark.parametrize("policy", [FCFSPolicy, PriorityPolicy])
def test_a_new_clients_request_is_admitted_ahead_of_a_flooders_queue(policy):
    scheduler = _scheduler(policy, max_num_seqs=16)
    _flood(scheduler, 200)  # 16 run, 184 wait
    step(scheduler)
    scheduler.add_request(_request("other", 200, "127.0.0.2", max_tokens=4))
    out, _ = step(scheduler)
    assert "other" in out.num_scheduled_tokens  # max_num_seqs is full: it waits for a seat
    _finish(scheduler)


def test_a_new_clients_request_takes_the_first_free_seat():
    scheduler = _scheduler(max_num_seqs=16)
    _flood(scheduler, 200)
    for _ in range(2):
        step(scheduler)
    scheduler.add_request(_request("other", 200, "127.0.0.2", max_tokens=4))
    scheduler.finish_requests("flood-0", RequestStatus.FINISHED_ABORTED)  # one seat frees
    out, _ = step(scheduler)
    new = [r.req_id for r in out.scheduled_new_reqs]
    assert new == ["other"], new  # not the 184 flood requests queued before it
    _finish(scheduler)


def test_one_client_alone_and_a_cap_of_zero_are_not_capped():
    for cap, second_client in ((CAP, None), (0, "127.0.0.2")):
        scheduler = _scheduler(cap=cap)
        _flood(scheduler, FLOOD, client=None)
        step(scheduler)
        scheduler.add_request(_request("other", FLOOD, second_client, max_tokens=4))
        out, _ = step(scheduler)
        assert _per_step(out, "flood-") == FLOOD and "other" in out.num_scheduled_tokens
        _finish(scheduler)


def test_the_client_is_the_policys_to_name():
    class ByUser(FCFSPolicy):
        def client_key(self, request):
            return (request.extra or {}).get("user")

    scheduler = _scheduler(ByUser)
    for i in range(FLOOD):
        request = make_request(f"flood-{i}", [7] * 12, max_tokens=400, seq_no=i)
        request.extra = {"user": "batch-job"}
        scheduler.add_request(request)
    step(scheduler)
    other = make_request("other", [7] * 12, max_tokens=4, seq_no=FLOOD)
    other.extra = {"user": "alice"}
    scheduler.add_request(other)
    out, _ = step(scheduler)
    assert _per_step(out, "flood-") == CAP and "other" in out.num_scheduled_tokens
    _finish(scheduler)
