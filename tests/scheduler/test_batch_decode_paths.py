"""The scheduler's batch-wide paths for plain decode steps give what the per-request
paths give, and are taken.

``schedule`` decides at once which running requests take one more token in the blocks
they hold (``KVCacheManager.one_more_token_fits``); ``update_from_output`` sends a plain
step (one token that finishes nothing) as columns of ``EngineCoreOutputs`` where the
engine asked for them. A scheduler with both turned off is driven beside one with both
on, through the same requests and sampled tokens (prefix caching, a pool small enough
to preempt, stop tokens, EOS, aborts, synchronous and two batches in flight), and every
step's scheduler output and request outputs must match."""

from __future__ import annotations

import itertools
import zlib
from collections import deque
from typing import Any

import msgspec
import pytest

from enginecore.protocol import EngineCoreOutput
from enginecore.request import Request, RequestStatus
from enginecore.runner_output import ModelRunnerOutput
from enginecore.scheduler_output import SchedulerOutput
from enginecore_schedulers.scheduler import DefaultScheduler
from tests.helpers.scheduler import EOS_TOKEN_ID, create_scheduler, make_request, samples_token

NUM_REQUESTS = 40


def _requests() -> list[Request]:
    requests = []
    for i in range(NUM_REQUESTS):
        shared = [7] * (16 * (i % 3))  # prefixes several requests share (prefix caching)
        prompt = shared + [100 + i + j for j in range(5 + (i * 7) % 23)]
        params: dict[str, Any] = {}
        if i % 5 == 1:
            params["stop_token_ids"] = [3]
        if i % 7 == 2:
            params["ignore_eos"] = True
        max_tokens = 4 + (i * 11) % 37
        requests.append(
            make_request(
                f"r{i}", prompt, max_tokens=max_tokens, seq_no=i, client_index=i % 2, **params
            )
        )
    return requests


def _token(request_id: str, step: int) -> int:
    """The token the fake runner samples: now and then EOS or the stop token 3."""
    value = zlib.crc32(f"{request_id}:{step}".encode())
    if value % 41 == 0:
        return EOS_TOKEN_ID
    if value % 37 == 0:
        return 3
    return 10 + value % 500


def _runner_output(
    scheduler: DefaultScheduler, out: SchedulerOutput, step: int
) -> ModelRunnerOutput:
    req_ids = list(out.num_scheduled_tokens)
    sampled = [[_token(rid, step)] if samples_token(scheduler, out, rid) else [] for rid in req_ids]
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def _schedule_view(out: SchedulerOutput) -> Any:
    cached = out.scheduled_cached_reqs
    return (
        out.num_scheduled_tokens,
        out.total_num_scheduled_tokens,
        [(r.req_id, r.block_ids, r.num_computed_tokens) for r in out.scheduled_new_reqs],
        (cached.req_ids, cached.num_computed_tokens, cached.new_block_ids),
        sorted(out.preempted_req_ids),
        sorted(out.finished_req_ids),
    )


def _outputs_view(engine_outputs: dict[int, Any], seen: set[str]) -> dict[int, Any]:
    """Per client: each request's output; ``num_cached_tokens`` is read from a first
    output only, so it is compared there only."""
    view: dict[int, Any] = {}
    for client, client_outputs in engine_outputs.items():
        rows: dict[str, EngineCoreOutput] = {}
        for out in client_outputs.all_outputs():
            if out.request_id in seen:
                out = msgspec.structs.replace(out, num_cached_tokens=0)
            if out.events:  # their kinds: the clock differs between the runs
                out = msgspec.structs.replace(out, events=[(kind, 0.0) for kind, _ in out.events])
            rows[out.request_id] = out
        seen.update(rows)
        view[client] = (rows, client_outputs.scheduler_stats)
    return view


def _drive(batched: bool, depth: int) -> tuple[list[Any], DefaultScheduler]:
    scheduler = create_scheduler(
        max_num_seqs=24, prefix_caching=True, num_blocks=20, max_num_batched_tokens=512
    )
    if batched:
        scheduler.plain_output_columns = True
    else:
        # The seam: without the batch-wide check every request takes allocate_slots.
        scheduler.kv_cache_manager.one_more_token_fits = lambda requests: None  # type: ignore[method-assign]
    pending = deque(_requests())
    for _ in range(8):
        scheduler.add_request(pending.popleft())
    trace: list[Any] = []
    seen: set[str] = set()
    in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    for step in itertools.count():
        assert step < 2000, "requests did not finish"
        if step % 3 == 0 and pending:
            scheduler.add_request(pending.popleft())
        if step == 30:
            scheduler.finish_requests(["r2", "r5"], RequestStatus.FINISHED_ABORTED)
        if not scheduler.has_requests() and not in_flight and not pending:
            break
        if scheduler.has_requests() and len(in_flight) < depth:
            out = scheduler.schedule()
            trace.append(("schedule", _schedule_view(out)))
            in_flight.append((out, _runner_output(scheduler, out, step)))
            if len(in_flight) < depth and out.total_num_scheduled_tokens:
                continue
        if in_flight:
            out, runner_output = in_flight.popleft()
            outputs = scheduler.update_from_output(out, runner_output)
            trace.append(("update", _outputs_view(outputs, seen)))
    return trace, scheduler


@pytest.mark.parametrize("depth", [1, 2], ids=["sync", "async"])
def test_batch_paths_match_the_per_request_paths(depth: int) -> None:
    batched_trace, batched = _drive(batched=True, depth=depth)
    general_trace, general = _drive(batched=False, depth=depth)
    assert len(batched_trace) == len(general_trace)
    for got, want in zip(batched_trace, general_trace, strict=True):
        assert got == want
    # Both ran into the cases the batch paths hand to the per-request ones.
    assert any(view[4] for kind, view in batched_trace if kind == "schedule")  # preempted
    finishes = [
        out.finish_reason
        for kind, view in batched_trace
        if kind == "update"
        for rows, _ in view.values()
        for out in rows.values()
        if out.finish_reason is not None
    ]
    assert len(set(finishes)) >= 2  # stopped (EOS, stop token) and length-capped
    # The batch paths were taken, and only in the batched run.
    assert batched.num_fast_decodes > 100 and batched.num_plain_outputs > 100
    assert general.num_fast_decodes == 0 and general.num_plain_outputs == 0
