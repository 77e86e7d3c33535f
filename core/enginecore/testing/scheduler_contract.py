"""``SchedulerContract`` and ``SchedulingPolicyContract``: what the engine relies on.

Subclass one in your own pytest tests and point it at your class::

    from enginecore.testing import SchedulerContract, SchedulingPolicyContract

    class TestMyScheduler(SchedulerContract):
        scheduler = "my-scheduler"    # a registered name, or the class itself

    class TestMyPolicy(SchedulingPolicyContract):
        policy = "my-policy"          # runs inside the built-in scheduler

No model and no device: a :class:`FakeWorker` plays the workers' part. It executes every
``SchedulerOutput`` the way a real worker would (it keeps each request's tokens and block
table, samples a token whenever a step completes the known tokens) and checks, on every
step, the invariants the engine relies on: the token budget and ``max_num_seqs``, only
known requests scheduled, never more tokens than a request has, enough KV blocks for the
tokens computed, no block owned by two live requests, every block freed once a request
finishes or is aborted, exactly ``max_tokens`` tokens per request in arrival-independent
order, and -- with two batches in flight -- async-scheduling placeholders.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest

from enginecore.interfaces import Scheduler, SchedulerState, SchedulingPolicy
from enginecore.params import SamplingParams
from enginecore.protocol import EngineCoreOutputs
from enginecore.request import FinishReason, Request, RequestStatus
from enginecore.runner_output import ModelRunnerOutput
from enginecore.scheduler_output import SchedulerOutput

EOS_TOKEN_ID = 2


def sampled_token(req_id: str, index: int) -> int:
    """What the fake runner samples as a request's ``index``-th output token (never EOS)."""
    return 1000 + (sum(map(ord, req_id)) * 31 + index) % 5000


@dataclass
class _WorkerRequest:
    prompt_len: int
    block_ids: list[int]
    computed: int
    generated: list[int] = field(default_factory=list)


class FakeWorker:
    """Executes SchedulerOutputs as a worker would, asserting the scheduler's invariants."""

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        exclusive_blocks: bool = True,
        eos_for: Iterable[str] = (),
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.budget = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.exclusive_blocks = exclusive_blocks
        self.eos_for = set(eos_for)
        self.requests: dict[str, _WorkerRequest] = {}
        self.num_steps = 0

    def _owner_check(self, req_id: str, block_ids: list[int]) -> None:
        for b in block_ids:
            assert 0 <= b < self.num_blocks, f"{req_id}: block id {b} outside the cache"
        if not self.exclusive_blocks:
            return
        for other_id, other in self.requests.items():
            if other_id != req_id:
                shared = set(block_ids) & set(other.block_ids)
                assert not shared, f"blocks {sorted(shared)} given to {req_id} and {other_id}"

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.requests.pop(req_id, None)
        scheduled = out.num_scheduled_tokens
        assert out.total_num_scheduled_tokens == sum(scheduled.values()), (
            "total_num_scheduled_tokens is not the sum of num_scheduled_tokens"
        )
        assert out.total_num_scheduled_tokens <= self.budget, (
            f"{out.total_num_scheduled_tokens} tokens scheduled, budget {self.budget}"
        )
        assert len(scheduled) <= self.max_num_seqs, (
            f"{len(scheduled)} requests scheduled, max_num_seqs {self.max_num_seqs}"
        )
        assert all(n > 0 for n in scheduled.values()), f"zero-token entries: {scheduled}"
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.requests, f"{new.req_id} sent as new twice"
            self._owner_check(new.req_id, new.block_ids)
            self.requests[new.req_id] = _WorkerRequest(
                prompt_len=len(new.prompt_token_ids),
                block_ids=list(new.block_ids),
                computed=new.num_computed_tokens,
                generated=list(new.output_token_ids),
            )
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            assert req_id in self.requests, f"{req_id} scheduled as cached but never sent"
            new_blocks = cached.new_block_ids[i] if i < len(cached.new_block_ids) else None
            if new_blocks:
                self._owner_check(req_id, new_blocks)
                self.requests[req_id].block_ids.extend(new_blocks)
        new_ids = [n.req_id for n in out.scheduled_new_reqs]
        assert set(scheduled) == set(new_ids) | set(cached.req_ids), (
            "num_scheduled_tokens and the new/cached request lists disagree"
        )
        sampled: list[list[int]] = []
        for req_id, n in scheduled.items():
            state = self.requests[req_id]
            known = state.prompt_len + len(state.generated)
            assert state.computed + n <= known, (
                f"{req_id}: {n} tokens scheduled from position {state.computed}, but only "
                f"{known} tokens exist (placeholders must not be scheduled twice)"
            )
            state.computed += n
            needed = math.ceil(state.computed / self.block_size)
            assert len(state.block_ids) >= needed, (
                f"{req_id}: {state.computed} tokens need {needed} blocks, got "
                f"{len(state.block_ids)}"
            )
            if state.computed == known:
                index = len(state.generated)
                token = EOS_TOKEN_ID if req_id in self.eos_for else sampled_token(req_id, index)
                state.generated.append(token)
                sampled.append([token])
            else:
                sampled.append([])
        req_ids = list(scheduled)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )


@dataclass
class RunResult:
    tokens: dict[str, list[int]]
    finish_reasons: dict[str, FinishReason]
    outputs: list[SchedulerOutput]


class SchedulerContract:
    """Subclass and set ``scheduler`` (a registered name or the class)."""

    scheduler: ClassVar[Any] = "default"
    policy: ClassVar[Any] = "fcfs"
    num_blocks: ClassVar[int] = 64
    block_size: ClassVar[int] = 16
    max_num_seqs: ClassVar[int] = 8
    max_num_batched_tokens: ClassVar[int] = 64
    max_model_len: ClassVar[int] = 1024
    #: flat config keys to set (``{"chunked_prefill": False}``)
    config_overrides: ClassVar[dict[str, Any]] = {}

    # --- construction ------------------------------------------------------------------

    @classmethod
    def make_config(cls, **overrides: Any) -> Any:
        from enginecore.config import make_config

        flat: dict[str, Any] = {
            "model": "contract-fake-model",
            "block_size": cls.block_size,
            "max_num_seqs": cls.max_num_seqs,
            "max_num_batched_tokens": cls.max_num_batched_tokens,
            "prefix_caching": False,
        }
        if isinstance(cls.scheduler, str):
            flat["scheduler_name"] = cls.scheduler
        if isinstance(cls.policy, str):
            flat["scheduling_policy"] = cls.policy
        flat.update(cls.config_overrides)
        flat.update(overrides)
        return make_config(**flat)

    @classmethod
    def _resolve(cls, kind: str, what: Any) -> Any:
        if not isinstance(what, str):
            return what
        from enginecore.plugins import make_plugin_manager

        return make_plugin_manager(strict=False).registry(kind).get(what)

    def make_scheduler(self, num_blocks: int | None = None, **overrides: Any) -> Scheduler:
        config = self.make_config(**overrides)
        scheduler_cls = self._resolve("scheduler", self.scheduler)
        policy_cls = self._resolve("scheduling_policy", self.policy)
        scheduler = scheduler_cls(
            config,
            num_blocks=num_blocks or self.num_blocks,
            max_model_len=self.max_model_len,
            policy=policy_cls(config),
            kv_connector=None,
            log_stats=True,
        )
        assert isinstance(scheduler, Scheduler), "schedulers subclass interfaces.Scheduler"
        return scheduler

    def make_worker(
        self, scheduler: Scheduler, num_blocks: int | None = None, **kw: Any
    ) -> FakeWorker:
        config = getattr(scheduler, "config", None)
        budget = getattr(scheduler, "max_num_batched_tokens", self.max_num_batched_tokens)
        return FakeWorker(
            num_blocks=num_blocks or self.num_blocks,
            block_size=self.block_size,
            max_num_batched_tokens=budget,
            max_num_seqs=config.scheduler.max_num_seqs if config else self.max_num_seqs,
            exclusive_blocks=not (config and config.cache.prefix_caching),
            **kw,
        )

    @staticmethod
    def make_request(
        req_id: str,
        prompt_len: int,
        max_tokens: int = 8,
        seq_no: int = 0,
        priority: int = 0,
        extra: dict[str, Any] | None = None,
    ) -> Request:
        prompt = [(seq_no * 7 + i) % 900 + 3 for i in range(prompt_len)]
        return Request(
            req_id,
            prompt,
            SamplingParams(max_tokens=max_tokens, temperature=0.0, extra=extra),
            eos_token_id=EOS_TOKEN_ID,
            arrival_time=0.0,
            seq_no=seq_no,
            priority=priority,
        )

    def mixed_requests(self, count: int = 12) -> list[Request]:
        rng = random.Random(0)
        return [
            self.make_request(
                f"req-{i}",
                prompt_len=rng.choice([1, 5, 16, 17, 40, 100]),
                max_tokens=rng.randint(1, 12),
                seq_no=i,
                priority=rng.randint(0, 3),
                extra={"tenant": f"tenant-{rng.randint(0, 2)}"},
            )
            for i in range(count)
        ]

    # --- drivers -----------------------------------------------------------------------

    @staticmethod
    def _collect(engine_outputs: dict[int, EngineCoreOutputs], result: RunResult) -> None:
        for outs in engine_outputs.values():
            for o in outs.outputs:
                result.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    assert o.request_id not in result.finish_reasons, (
                        f"{o.request_id} reported finished twice"
                    )
                    result.finish_reasons[o.request_id] = o.finish_reason

    def run(
        self,
        scheduler: Scheduler,
        worker: FakeWorker,
        *,
        in_flight: int = 1,
        max_steps: int = 5000,
    ) -> RunResult:
        """Step until no request is left, with ``in_flight`` batches scheduled ahead."""
        result = RunResult({}, {}, [])
        queue: deque[Any] = deque()
        for _ in range(max_steps):
            if not scheduler.has_requests() and not queue:
                return result
            if len(queue) < in_flight and scheduler.has_requests():
                out = scheduler.schedule()
                result.outputs.append(out)
                queue.append((out, worker.execute(out)))
                if len(queue) < in_flight and out.total_num_scheduled_tokens:
                    continue
            out, runner_output = queue.popleft()
            self._collect(scheduler.update_from_output(out, runner_output), result)
        raise AssertionError(f"requests did not finish within {max_steps} steps")

    def assert_all_freed(self, scheduler: Scheduler, worker: FakeWorker) -> None:
        if scheduler.has_finished_requests():
            out = scheduler.schedule()  # tells the workers which ids to drop
            worker.execute(out)
        assert not scheduler.has_requests(), "requests left after every one finished"
        assert scheduler.get_num_unfinished_requests() == 0
        assert scheduler.get_request_counts() == (0, 0)
        assert not worker.requests, f"workers still hold {sorted(worker.requests)}"
        stats = scheduler.make_stats()
        if stats is not None:
            assert stats.kv_cache_usage == 0.0, f"KV cache usage {stats.kv_cache_usage} > 0"
        # Every block is free again: a request needing (almost) the whole cache runs.
        size = min((self.num_blocks - 2) * self.block_size, self.max_model_len) - 1
        config = getattr(scheduler, "config", None)
        if config is not None and not config.scheduler.chunked_prefill:
            size = min(size, getattr(scheduler, "max_num_batched_tokens", size))
        big = self.make_request("whole-cache", size, 1, seq_no=10**6)
        scheduler.add_request(big)
        result = self.run(scheduler, worker)
        assert len(result.tokens["whole-cache"]) == 1, "the whole cache could not be used again"
        if scheduler.has_finished_requests():
            worker.execute(scheduler.schedule())

    # --- the contract ------------------------------------------------------------------

    def test_budget_and_limits_hold_every_step(self) -> None:
        scheduler = self.make_scheduler()
        worker = self.make_worker(scheduler)
        requests = self.mixed_requests()
        for r in requests:
            scheduler.add_request(r)
        result = self.run(scheduler, worker)
        assert {r.request_id for r in requests} == set(result.finish_reasons)
        for r in requests:
            assert r.max_tokens is not None  # mixed_requests sets every length
            expected = [sampled_token(r.request_id, i) for i in range(r.max_tokens)]
            assert result.tokens[r.request_id] == expected, r.request_id
            assert result.finish_reasons[r.request_id] == FinishReason.LENGTH
        self.assert_all_freed(scheduler, worker)

    def test_every_block_of_finished_requests_is_freed(self) -> None:
        scheduler = self.make_scheduler()
        worker = self.make_worker(scheduler)
        for round_ in range(3):  # leaks would pile up round after round
            for i in range(6):
                scheduler.add_request(
                    self.make_request(f"r{round_}-{i}", 30 + i, 4, seq_no=round_ * 10 + i)
                )
            self.run(scheduler, worker)
        self.assert_all_freed(scheduler, worker)

    def test_aborted_requests_free_their_blocks(self) -> None:
        scheduler = self.make_scheduler()
        worker = self.make_worker(scheduler)
        requests = [self.make_request(f"a{i}", 20, 50, seq_no=i) for i in range(10)]
        for r in requests:
            scheduler.add_request(r)
        for _ in range(3):
            out = scheduler.schedule()
            scheduler.update_from_output(out, worker.execute(out))
        aborted = [r.request_id for r in requests[::2]]
        finished = scheduler.finish_requests(aborted, RequestStatus.FINISHED_ABORTED)
        assert sorted(r.request_id for r in finished) == sorted(aborted)
        # Idempotent: unknown and already-finished ids are ignored.
        assert scheduler.finish_requests(["a0", "nope"], RequestStatus.FINISHED_ABORTED) == []
        assert scheduler.has_finished_requests()
        out = scheduler.schedule()
        assert set(aborted) <= out.finished_req_ids, "aborted ids must reach the workers"
        assert not set(aborted) & set(out.num_scheduled_tokens), "aborted requests scheduled"
        scheduler.update_from_output(out, worker.execute(out))
        result = self.run(scheduler, worker)
        assert not set(aborted) & set(result.finish_reasons)
        scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
        self.assert_all_freed(scheduler, worker)

    def test_requests_finish_under_memory_pressure(self) -> None:
        """More KV demand than blocks: preemption (or waiting) must still finish all."""
        num_blocks = 12
        scheduler = self.make_scheduler(num_blocks=num_blocks)
        worker = self.make_worker(scheduler, num_blocks=num_blocks)
        requests = [self.make_request(f"p{i}", 40, 30, seq_no=i) for i in range(6)]
        for r in requests:
            scheduler.add_request(r)
        result = self.run(scheduler, worker)
        for r in requests:
            assert result.tokens[r.request_id] == [
                sampled_token(r.request_id, i) for i in range(30)
            ]
        if scheduler.has_finished_requests():
            worker.execute(scheduler.schedule())
        stats = scheduler.make_stats()
        assert stats is None or stats.kv_cache_usage == 0.0
        assert not worker.requests

    def test_eos_finishes_a_request_and_frees_it(self) -> None:
        scheduler = self.make_scheduler()
        worker = self.make_worker(scheduler, eos_for=["stops"])
        scheduler.add_request(self.make_request("stops", 10, 20, seq_no=0))
        scheduler.add_request(self.make_request("runs", 10, 3, seq_no=1))
        result = self.run(scheduler, worker)
        assert result.tokens["stops"] == [EOS_TOKEN_ID]
        assert result.finish_reasons["stops"] == FinishReason.STOP
        assert len(result.tokens["runs"]) == 3
        self.assert_all_freed(scheduler, worker)

    def test_async_scheduling_with_placeholders(self) -> None:
        """Two batches in flight (the engine's default loop) give the sync results."""
        scheduler_cls = self._resolve("scheduler", self.scheduler)
        if not getattr(scheduler_cls, "supports_async_scheduling", False):
            pytest.skip(f"{scheduler_cls.__name__}.supports_async_scheduling is False")
        sync_s = self.make_scheduler(async_scheduling=False)
        async_s = self.make_scheduler(async_scheduling=True)
        sync_w, async_w = self.make_worker(sync_s), self.make_worker(async_s)
        for s in (sync_s, async_s):
            for r in self.mixed_requests():
                s.add_request(r)
        expected = self.run(sync_s, sync_w)
        got = self.run(async_s, async_w, in_flight=2)
        assert got.tokens == expected.tokens
        assert got.finish_reasons == expected.finish_reasons
        self.assert_all_freed(async_s, async_w)

    def test_stats_describe_the_last_step(self) -> None:
        scheduler = self.make_scheduler()
        worker = self.make_worker(scheduler)
        for i in range(3):
            scheduler.add_request(self.make_request(f"s{i}", 8, 4, seq_no=i))
        out = scheduler.schedule()
        scheduler.update_from_output(out, worker.execute(out))
        stats = scheduler.make_stats()
        if stats is not None:
            assert stats.num_running_reqs + stats.num_waiting_reqs == 3
            assert 0.0 < stats.kv_cache_usage <= 1.0
        scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
        self.assert_all_freed(scheduler, worker)

    def test_reset_prefix_cache_is_safe(self) -> None:
        scheduler = self.make_scheduler()
        worker = self.make_worker(scheduler)
        assert isinstance(scheduler.reset_prefix_cache(), bool)
        scheduler.add_request(self.make_request("x", 20, 2))
        self.run(scheduler, worker)
        assert scheduler.reset_prefix_cache() in (True, False)
        self.assert_all_freed(scheduler, worker)


class SchedulingPolicyContract(SchedulerContract):
    """Subclass and set ``policy`` (a registered name or the class).

    The policy's methods are checked on their own (deterministic, pure, total order) and
    then the whole :class:`SchedulerContract` runs with the policy inside the built-in
    scheduler -- including async scheduling, which any policy must keep working.
    """

    scheduler: ClassVar[Any] = "default"
    policy: ClassVar[Any] = "fcfs"

    def make_policy(self) -> SchedulingPolicy:
        config = self.make_config()
        policy = self._resolve("scheduling_policy", self.policy)(config)
        assert isinstance(policy, SchedulingPolicy), "policies subclass SchedulingPolicy"
        return policy

    @staticmethod
    def _snapshot(request: Request) -> tuple[Any, ...]:
        return (
            request.num_computed_tokens,
            list(request.output_token_ids),
            request.status,
            request.max_tokens,
            request.priority,
        )

    def test_sort_key_is_deterministic_and_pure(self) -> None:
        policy = self.make_policy()
        for request in self.mixed_requests():
            before = self._snapshot(request)
            assert policy.sort_key(request) == policy.sort_key(request)
            assert self._snapshot(request) == before, "sort_key must not change the request"

    def test_queue_order_does_not_depend_on_arrival_order_or_history(self) -> None:
        """Keys form a total order (break ties with ``request.seq_no``) that a fresh
        instance computes alike: a policy remembering what it saw (say, a tenant's first
        appearance) orders a shuffled queue differently, and fails here."""
        requests = self.mixed_requests(20)
        expected = [r.request_id for r in sorted(requests, key=self.make_policy().sort_key)]
        for seed in range(20):
            shuffled = list(requests)
            random.Random(seed).shuffle(shuffled)
            policy = self.make_policy()
            order = [r.request_id for r in sorted(shuffled, key=policy.sort_key)]
            assert order == expected, f"shuffle {seed} gave another order: keep no state"

    def _state_with(self, running: list[Request], waiting: list[Request]) -> SchedulerState:
        return SchedulerState(
            num_running=len(running),
            num_waiting=len(waiting),
            num_free_blocks=32,
            num_total_blocks=64,
            token_budget_left=64,
            step=1,
            running=tuple(running),
            waiting=tuple(waiting),
        )

    def test_admit_is_pure_across_fresh_instances(self) -> None:
        """``admit`` decides from the request and the state alone: the same question gets
        the same answer however often, in whatever order, and from any instance."""
        requests = self.mixed_requests(12)
        for r in requests[:6]:
            r.status = RequestStatus.RUNNING
        state = self._state_with(requests[:6], requests[6:])
        questions = requests[6:]
        before = [self._snapshot(r) for r in requests]
        expected = [self.make_policy().admit(r, state) for r in questions]
        for seed in range(10):
            order = list(range(len(questions)))
            random.Random(seed).shuffle(order)
            policy = self.make_policy()
            answers = {i: policy.admit(questions[i], state) for i in order}
            assert [answers[i] for i in range(len(questions))] == expected, (
                f"admit answered differently in shuffle {seed}: keep no state"
            )
        assert [self._snapshot(r) for r in requests] == before, "admit must not change requests"

    def test_preemption_victim_is_a_running_request(self) -> None:
        policy = self.make_policy()
        running = self.mixed_requests(6)
        for r in running:
            r.status = RequestStatus.RUNNING
        before = [self._snapshot(r) for r in running]
        victim = policy.pick_preemption_victim(running)
        assert any(victim is r for r in running), "the victim must come from `running`"
        assert [self._snapshot(r) for r in running] == before
        assert policy.pick_preemption_victim(running[:1]) is running[0]

    def test_admit_answers_a_bool(self) -> None:
        policy = self.make_policy()
        for free in (0, 4, 64):
            state = SchedulerState(
                num_running=2,
                num_waiting=3,
                num_free_blocks=free,
                num_total_blocks=64,
                token_budget_left=32,
                step=1,
            )
            for r in self.mixed_requests(4):
                assert isinstance(policy.admit(r, state), bool)
