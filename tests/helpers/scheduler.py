"""Shared helpers for the scheduler and KV-cache tests: no model, no device.

Schedulers are built with a fake KV cache (block bookkeeping only); model runner outputs
are built by hand, the way vLLM's CPU scheduler tests do it. Every scheduler built by
:func:`create_scheduler` is leak-checked after the test by :func:`leak_check`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import pytest

from enginecore import SamplingParams, make_config
from enginecore.request import Request, RequestStatus
from enginecore.runner_output import ModelRunnerOutput
from enginecore.scheduler_output import SchedulerOutput
from enginecore_schedulers.policies import FCFSPolicy, PriorityPolicy
from enginecore_schedulers.scheduler import DefaultScheduler

EOS_TOKEN_ID = 50_000
SAMPLED_TOKEN = 1000  # what the fake runner samples unless told otherwise

_created: list[DefaultScheduler] = []


def create_scheduler(
    *,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int | None = 8192,
    chunked_prefill: bool = True,
    prefix_caching: bool = False,
    long_prefill_token_threshold: int = 0,
    num_blocks: int = 10_000,
    block_size: int = 16,
    max_model_len: int | None = None,
    policy: str = "fcfs",
    hash_algo: str = "sha256",
    log_stats: bool = True,
    kv_cache_groups: list[int | None] | None = None,
) -> DefaultScheduler:
    config = make_config(
        model="fake",
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        chunked_prefill=chunked_prefill,
        prefix_caching=prefix_caching,
        prefix_caching_hash_algo=hash_algo,
        long_prefill_token_threshold=long_prefill_token_threshold,
        scheduling_policy=policy,
    )
    policy_cls = {"fcfs": FCFSPolicy, "priority": PriorityPolicy}[policy]
    scheduler = DefaultScheduler(
        config,
        num_blocks=num_blocks,
        max_model_len=max_model_len or max_num_batched_tokens or 8192,
        policy=policy_cls(config),
        log_stats=log_stats,
        kv_cache_groups=kv_cache_groups,
    )
    _created.append(scheduler)
    return scheduler


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    *,
    max_tokens: int | None = 16,
    seq_no: int = 0,
    priority: int = 0,
    cache_salt: str | None = None,
    client_index: int = 0,
    **params: object,
) -> Request:
    return Request(
        request_id,
        list(prompt_token_ids),
        SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]  # any fields
        eos_token_id=EOS_TOKEN_ID,
        arrival_time=0.0,
        seq_no=seq_no,
        priority=priority,
        cache_salt=cache_salt,
        client_index=client_index,
    )


def create_requests(
    num_requests: int,
    num_tokens: int = 10,
    *,
    max_tokens: int | None = 16,
    same_prompt: bool = False,
    start: int = 0,
    priorities: list[int] | None = None,
    **params: object,
) -> list[Request]:
    """Request i (id ``str(i)``) has prompt ``[i] * num_tokens`` (zeros with same_prompt)."""
    return [
        make_request(
            str(i),
            [0 if same_prompt else i] * num_tokens,
            max_tokens=max_tokens,
            seq_no=i,
            priority=priorities[i - start] if priorities else 0,
            **params,
        )
        for i in range(start, start + num_requests)
    ]


def samples_token(scheduler: DefaultScheduler, out: SchedulerOutput, req_id: str) -> bool:
    """Whether this step completes the request's known tokens (so the runner samples)."""
    n = out.num_scheduled_tokens[req_id]
    for new in out.scheduled_new_reqs:
        if new.req_id == req_id:
            return new.num_computed_tokens + n >= len(new.prompt_token_ids) + len(
                new.output_token_ids
            )
    cached = out.scheduled_cached_reqs
    before = cached.num_computed_tokens[cached.req_ids.index(req_id)]
    request = scheduler.requests.get(req_id)
    prompt_len = request.num_prompt_tokens if request is not None else 0
    return before + n >= prompt_len


def make_output(
    scheduler: DefaultScheduler,
    out: SchedulerOutput,
    tokens: dict[str, list[int]] | None = None,
    default: int = SAMPLED_TOKEN,
) -> ModelRunnerOutput:
    """A fake runner output: every request that finishes its prefill samples a token."""
    tokens = tokens or {}
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        if req_id in tokens:
            sampled.append(list(tokens[req_id]))
        elif samples_token(scheduler, out, req_id):
            sampled.append([default])
        else:
            sampled.append([])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def step(
    scheduler: DefaultScheduler, tokens: dict[str, list[int]] | None = None
) -> tuple[SchedulerOutput, dict]:
    """One synchronous engine step."""
    out = scheduler.schedule()
    return out, scheduler.update_from_output(out, make_output(scheduler, out, tokens))


def outputs_by_request(engine_outputs: dict) -> dict:
    return {o.request_id: o for outs in engine_outputs.values() for o in outs.outputs}


def run_to_completion(scheduler: DefaultScheduler, max_steps: int = 10_000) -> list:
    """Synchronous steps until no request is left; returns the SchedulerOutputs."""
    outs = []
    for _ in range(max_steps):
        if not scheduler.has_requests():
            return outs
        out, _ = step(scheduler)
        outs.append(out)
    raise AssertionError("requests did not finish")


def run_async(
    scheduler: DefaultScheduler, depth: int = 2, max_steps: int = 10_000
) -> Iterator[tuple[SchedulerOutput, dict]]:
    """Like the engine's batch queue: keep ``depth`` batches in flight, oldest first.

    Yields each applied ``(scheduler_output, engine_outputs)``.
    """
    in_flight: deque = deque()
    for _ in range(max_steps):
        if not scheduler.has_requests() and not in_flight:
            return
        if len(in_flight) < depth and scheduler.has_requests():
            out = scheduler.schedule()
            # The runner decides at launch time, like a real worker would.
            in_flight.append((out, make_output(scheduler, out)))
            if len(in_flight) < depth and out.total_num_scheduled_tokens:
                continue
        out, runner_output = in_flight.popleft()
        yield out, scheduler.update_from_output(out, runner_output)
    raise AssertionError("requests did not finish")


def assert_no_leaks(scheduler: DefaultScheduler) -> None:
    if scheduler.has_finished_requests():
        scheduler.schedule()  # report the finished ids to the (fake) workers
    problems = scheduler.leak_report()
    assert not problems, problems
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks)


@pytest.fixture(autouse=True)
def leak_check():
    """After each test: abort what is left, then no request state and no held block."""
    _created.clear()
    yield
    schedulers = list(_created)
    _created.clear()
    for scheduler in schedulers:
        scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
        assert_no_leaks(scheduler)
