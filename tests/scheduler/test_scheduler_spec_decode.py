"""The scheduler's side of speculative decoding, with a fake worker and no model.

The fake worker behaves like the torch runner: it keeps each request's tokens, proposes
drafts with the real n-gram proposer after sampling, fills ``-1`` placeholder slots
from them, verifies against a deterministic "model" and reports how many drafts it
verified. Every step it checks that the scheduler allocated KV slots for every position
it computes and never scheduled past ``prompt + max_tokens - 1`` positions.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from enginecore import make_config
from enginecore.params import StructuredOutputParams
from enginecore.request import RequestStatus
from enginecore.runner_output import ModelRunnerOutput
from enginecore.scheduler_output import SchedulerOutput
from enginecore_models.ngram_proposer import NgramProposer
from enginecore_schedulers.policies import FCFSPolicy
from enginecore_schedulers.scheduler import DefaultScheduler
from tests.helpers.scheduler import EOS_TOKEN_ID, assert_no_leaks, make_request

K = 3
BLOCK = 4


def next_token(context: list[int]) -> int:
    """The fake model: a short cycle the n-gram proposer learns after one lap."""
    return 100 + (context[-1] * 3 + len(context) % 2) % 7


def make_scheduler(num_spec_tokens: int = K, num_blocks: int = 1000) -> DefaultScheduler:
    spec = (
        dict(speculative_method="ngram", num_speculative_tokens=num_spec_tokens)
        if num_spec_tokens
        else {}
    )
    config = make_config(model="fake", block_size=BLOCK, max_num_batched_tokens=64, **spec)
    return DefaultScheduler(
        config, num_blocks=num_blocks, max_model_len=512, policy=FCFSPolicy(config)
    )


class FakeSpecWorker:
    def __init__(self, spec_on: bool) -> None:
        config = make_config(model="fake", speculative_method="ngram", num_speculative_tokens=K)
        self.proposer = NgramProposer(config) if spec_on else None
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.blocks: dict[str, int] = {}
        self.drafts: dict[str, list[int]] = {}
        self.limits: dict[str, int] = {}
        self.slots_seen: list[list[int]] = []

    def run(self, so: SchedulerOutput, scheduler: DefaultScheduler) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.tokens.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
            self.blocks[new.req_id] = len(new.block_ids)
            self.drafts[new.req_id] = []
            request = scheduler.requests[new.req_id]
            self.limits[new.req_id] = request.num_prompt_tokens + request.max_tokens - 1
        cached = so.scheduled_cached_reqs
        for req_id, blocks in zip(cached.req_ids, cached.new_block_ids, strict=True):
            self.blocks[req_id] += len(blocks or ())
        req_ids = list(so.num_scheduled_tokens)
        sampled, verified, proposals = [], [], []
        for req_id in req_ids:
            slots = so.scheduled_spec_decode_tokens.get(req_id, [])
            self.slots_seen.append(list(slots))
            tokens = self.tokens[req_id]
            drafts = self.drafts[req_id][: len(slots)] if -1 in slots else list(slots)
            start = self.computed[req_id]
            end = start + so.num_scheduled_tokens[req_id] - len(slots)
            assert end + len(drafts) <= self.limits[req_id], "scheduled past max_tokens"
            assert end + len(drafts) <= self.blocks[req_id] * BLOCK, "no KV slot allocated"
            if end < len(tokens):  # a partial prefill chunk
                self.computed[req_id] = end
                sampled.append([])
                verified.append(0)
                proposals.append([])
                continue
            assert not drafts or start == len(tokens) - 1
            out = []
            context = list(tokens)
            for draft in drafts:
                out.append(next_token(context))
                if out[-1] != draft:
                    break
                context.append(draft)
            else:
                out.append(next_token(context))
            tokens += out
            self.computed[req_id] = len(tokens) - 1
            if self.proposer is not None:
                array = np.array(tokens, dtype=np.int64)
                self.drafts[req_id] = self.proposer.propose(array, K)
            sampled.append(out)
            verified.append(len(drafts))
            proposals.append(list(self.drafts[req_id]))
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            draft_token_ids=proposals if self.proposer is not None else None,
            num_draft_tokens=verified if self.proposer is not None else None,
        )


def drive(scheduler: DefaultScheduler, worker: FakeSpecWorker, depth: int) -> dict:
    """The engine loop with ``depth`` batches in flight (1: synchronous)."""
    outputs: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    totals = [0, 0, 0]
    preemptions = 0
    in_flight: deque = deque()
    for _ in range(10_000):
        if not scheduler.has_requests() and not in_flight:
            break
        if len(in_flight) < depth and scheduler.has_requests():
            so = scheduler.schedule()
            in_flight.append((so, worker.run(so, scheduler)))
            if len(in_flight) < depth and so.total_num_scheduled_tokens:
                continue
        so, runner_output = in_flight.popleft()
        for client in scheduler.update_from_output(so, runner_output).values():
            for out in client.outputs:
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    reasons[out.request_id] = str(out.finish_reason)
        stats = scheduler.make_stats()
        preemptions += stats.num_preemptions
        totals = [
            totals[0] + stats.spec_num_drafts,
            totals[1] + stats.spec_num_draft_tokens,
            totals[2] + stats.spec_num_accepted_tokens,
        ]
        per_pos = stats.spec_num_accepted_tokens_per_pos
        assert sum(per_pos) == stats.spec_num_accepted_tokens
        assert per_pos == sorted(per_pos, reverse=True)  # position k needs 0..k-1 accepted
    else:
        raise AssertionError("requests did not finish")
    return {"outputs": outputs, "reasons": reasons, "spec": totals, "preemptions": preemptions}


def add_requests(scheduler: DefaultScheduler) -> None:
    for i in range(6):
        scheduler.add_request(
            make_request(str(i), [1 + i, 2, 3 + i] * (1 + i), max_tokens=5 + 4 * i, seq_no=i)
        )
    # The prompt already holds the model's cycle: the first drafts are accepted and
    # EOS (106) comes up inside an accepted run.
    request = make_request("eos", [104, 105, 100, 100, 106, 104, 104, 105], max_tokens=40)
    request.seq_no = 7
    request.eos_token_id = 106
    scheduler.add_request(request)


@pytest.mark.parametrize("depth", [1, 2], ids=["sync", "async"])
def test_outputs_equal_the_non_speculative_run(depth: int) -> None:
    base_sched = make_scheduler(0)
    add_requests(base_sched)
    base = drive(base_sched, FakeSpecWorker(spec_on=False), depth)
    scheduler = make_scheduler()
    add_requests(scheduler)
    worker = FakeSpecWorker(spec_on=True)
    spec = drive(scheduler, worker, depth)
    assert spec["outputs"] == base["outputs"]
    assert spec["reasons"] == base["reasons"]
    assert spec["reasons"]["eos"] == "stop" and spec["outputs"]["eos"] == [100, 100, 106]
    assert [len(spec["outputs"][str(i)]) for i in range(6)] == [5 + 4 * i for i in range(6)]
    num_drafts, num_draft_tokens, num_accepted = spec["spec"]
    assert 0 < num_accepted <= num_draft_tokens <= K * num_drafts
    assert base["spec"] == [0, 0, 0]
    if depth == 1:  # nothing in flight: the scheduler sends the real draft ids
        assert all(-1 not in slots for slots in worker.slots_seen)
    else:  # a batch in flight: placeholders the worker fills in
        assert any(slots and set(slots) == {-1} for slots in worker.slots_seen)
    assert_no_leaks(scheduler)


def test_draft_slots_rollback_and_stats_step_by_step() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", [7, 8, 9], max_tokens=20))
    so = scheduler.schedule()
    assert so.scheduled_spec_decode_tokens == {}  # prefill: nothing sampled to draft from
    out = ModelRunnerOutput(
        req_ids=["r"], req_id_to_index={"r": 0}, sampled_token_ids=[[7]],
        draft_token_ids=[[8, 9, 7]], num_draft_tokens=[0],
    )  # fmt: skip
    scheduler.update_from_output(so, out)
    so = scheduler.schedule()
    assert so.scheduled_spec_decode_tokens == {"r": [8, 9, 7]}
    assert so.num_scheduled_tokens == {"r": 4} and so.total_num_scheduled_tokens == 4
    request = scheduler.requests["r"]
    assert request.num_computed_tokens == 3 + 4 and request.num_output_placeholders == 4
    # One draft accepted, then a different token: two rejected slots roll back.
    out = ModelRunnerOutput(
        req_ids=["r"], req_id_to_index={"r": 0}, sampled_token_ids=[[8, 5]],
        draft_token_ids=[[]], num_draft_tokens=[3],
    )  # fmt: skip
    scheduler.update_from_output(so, out)
    assert request.output_token_ids == [7, 8, 5]
    assert request.num_computed_tokens == len(request.all_token_ids) - 1
    assert request.num_output_placeholders == 0
    stats = scheduler.make_stats()
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens) == (1, 3)
    assert stats.spec_num_accepted_tokens == 1
    assert stats.spec_num_accepted_tokens_per_pos == [1]  # the first draft position only
    empty = scheduler.make_stats()
    assert empty.spec_num_drafts == 0 and empty.spec_num_accepted_tokens_per_pos == []
    so = scheduler.schedule()  # no drafts proposed: a plain decode
    assert so.scheduled_spec_decode_tokens == {} and so.num_scheduled_tokens == {"r": 1}
    scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)


def test_no_drafts_for_structured_output_or_without_room() -> None:
    scheduler = make_scheduler()
    grammar = make_request(
        "g", [1, 2], max_tokens=10, structured_output=StructuredOutputParams(regex="a+")
    )
    short = make_request("s", [1, 2], max_tokens=2, seq_no=1)
    scheduler.add_request(grammar)
    scheduler.add_request(short)
    so = scheduler.schedule()
    out = ModelRunnerOutput(
        req_ids=["g", "s"], req_id_to_index={"g": 0, "s": 1}, sampled_token_ids=[[1], [1]],
        draft_token_ids=[[2, 1, 2], [2, 1, 2]], num_draft_tokens=[0, 0],
    )  # fmt: skip
    scheduler.update_from_output(so, out)
    so = scheduler.schedule()
    # The grammar request gets none; the other has room for its last token only.
    assert so.scheduled_spec_decode_tokens == {}
    assert so.num_scheduled_tokens == {"g": 1, "s": 1}
    scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)


def test_preemption_with_drafts_in_flight() -> None:
    """A tiny KV cache forces preemptions while speculative batches are in flight."""
    scheduler = make_scheduler(num_blocks=24)
    base_sched = make_scheduler(0, num_blocks=24)
    for s in (scheduler, base_sched):
        for i in range(5):
            s.add_request(make_request(str(i), [1 + i, 2, 3] * 4, max_tokens=24, seq_no=i))
    base = drive(base_sched, FakeSpecWorker(spec_on=False), 2)
    spec = drive(scheduler, FakeSpecWorker(spec_on=True), 2)
    assert spec["outputs"] == base["outputs"]
    assert all(len(tokens) == 24 for tokens in spec["outputs"].values())
    assert spec["spec"][2] > 0 and spec["preemptions"] > 0
    assert_no_leaks(scheduler)
    assert EOS_TOKEN_ID not in spec["outputs"]["0"]
