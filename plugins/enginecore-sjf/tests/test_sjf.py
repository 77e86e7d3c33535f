"""Tests of the SJF policy. Run with the package installed (``pip install -e .``)."""

from __future__ import annotations

import pytest
from enginecore_sjf import ShortestJobFirstPolicy

import enginecore
from enginecore import SamplingParams, make_config
from enginecore.request import Request
from enginecore.testing import SchedulingPolicyContract


class TestSJFContract(SchedulingPolicyContract):
    """enginecore's conformance kit: the policy alone, then inside the built-in scheduler
    (budget, block freeing, preemption, async-scheduling placeholders)."""

    policy = "sjf"


def make_request(seq_no: int, prompt_len: int, max_tokens: int | None) -> Request:
    return Request(
        f"req-{seq_no}",
        list(range(prompt_len)),
        SamplingParams(max_tokens=max_tokens),
        seq_no=seq_no,
    )


@pytest.fixture
def policy() -> ShortestJobFirstPolicy:
    return ShortestJobFirstPolicy(make_config(max_model_len=4096))


def test_waiting_queue_is_ordered_by_remaining_work(policy):
    long_prompt = make_request(0, prompt_len=1000, max_tokens=10)
    long_output = make_request(1, prompt_len=10, max_tokens=500)
    short = make_request(2, prompt_len=20, max_tokens=20)
    order = sorted([long_prompt, long_output, short], key=policy.sort_key)
    assert [r.request_id for r in order] == ["req-2", "req-1", "req-0"]


def test_ties_are_broken_by_arrival(policy):
    first, second = make_request(5, 100, 16), make_request(9, 100, 16)
    assert policy.sort_key(first) < policy.sort_key(second)
    assert sorted([second, first], key=policy.sort_key) == [first, second]


def test_progress_shrinks_the_remaining_work(policy):
    request = make_request(0, prompt_len=100, max_tokens=50)
    assert policy.remaining_tokens(request) == 150
    request.num_computed_tokens = 100
    request.append_output_token_ids([1, 2, 3])
    assert policy.remaining_tokens(request) == 47


def test_unbounded_output_falls_back_to_max_model_len(policy):
    request = make_request(0, prompt_len=96, max_tokens=None)
    assert policy.remaining_tokens(request) == 96 + (4096 - 96)


def test_victim_is_the_longest_remaining_job(policy):
    running = [make_request(0, 10, 400), make_request(1, 10, 20), make_request(2, 10, 100)]
    assert policy.pick_preemption_victim(running).request_id == "req-0"


def test_admits_by_default(policy):
    from enginecore.interfaces import SchedulerState

    state = SchedulerState(
        num_running=0,
        num_waiting=1,
        num_free_blocks=8,
        num_total_blocks=8,
        token_budget_left=512,
        step=0,
    )
    assert policy.admit(make_request(0, 10, 10), state) is True


def test_the_installed_plugin_provides_sjf():
    """The entry point is wired: enginecore finds the plugin and resolves "sjf" lazily."""
    host = enginecore.make_plugin_manager()
    record = host.records["sjf"]
    assert record.loaded, record.error
    assert record.distribution == "enginecore-sjf"
    assert record.api_versions == ">=1.0,<2"
    registry = host.registry("scheduling_policy")
    assert registry.entry("sjf").plugin == "sjf"
    assert registry.get("sjf") is ShortestJobFirstPolicy
