"""The conformance kit itself: its checks fail on broken plugins, and it loads as a pytest
plugin without costing anything to test runs that do not use it."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap

import pytest

from enginecore.scheduler_output import SchedulerOutput
from enginecore.testing import (
    SchedulerContract,
    SchedulingPolicyContract,
    StatLoggerContract,
)
from enginecore.testing.scheduler_contract import FakeWorker
from enginecore_schedulers.policies import FCFSPolicy
from enginecore_schedulers.scheduler import DefaultScheduler
from enginecore_stat_loggers.logging_logger import LoggingStatLogger


class LeakyScheduler(DefaultScheduler):
    """Forgets aborted requests without freeing their blocks."""

    def finish_requests(self, request_ids, finished_status):
        freed = self.kv_cache_manager.free
        self.kv_cache_manager.free = lambda request: None
        try:
            return super().finish_requests(request_ids, finished_status)
        finally:
            self.kv_cache_manager.free = freed


class TestLeakyScheduler(SchedulerContract):
    scheduler = LeakyScheduler
    __test__ = False  # run by hand below


def test_a_scheduler_that_leaks_blocks_fails_the_contract():
    with pytest.raises(AssertionError, match=r"KV cache usage|whole cache"):
        TestLeakyScheduler().test_aborted_requests_free_their_blocks()


def test_the_fake_worker_rejects_a_step_over_budget():
    worker = FakeWorker(num_blocks=8, block_size=4, max_num_batched_tokens=4, max_num_seqs=2)
    out = SchedulerOutput(num_scheduled_tokens={"a": 5}, total_num_scheduled_tokens=5)
    with pytest.raises(AssertionError, match="5 tokens scheduled, budget 4"):
        worker.execute(out)


class RandomOrderPolicy(FCFSPolicy):
    def sort_key(self, request):
        return (request.priority,)  # ties keep whatever order the queue happened to have


class MutatingPolicy(FCFSPolicy):
    def sort_key(self, request):
        request.priority += 1
        return super().sort_key(request)


def test_policy_contract_catches_ties_and_side_effects():
    class Ties(SchedulingPolicyContract):
        policy = RandomOrderPolicy

    class Mutates(SchedulingPolicyContract):
        policy = MutatingPolicy

    with pytest.raises(AssertionError):
        Ties().test_queue_order_does_not_depend_on_arrival_order_or_history()
    with pytest.raises(AssertionError, match="must not change the request"):
        Mutates().test_sort_key_is_deterministic_and_pure()


class FirstSeenTenantPolicy(FCFSPolicy):
    """Orders tenants by when this instance first saw them: hidden state."""

    def __init__(self, config):
        super().__init__(config)
        self.tenants: dict[str, int] = {}

    def sort_key(self, request):
        tenant = (request.extra or {}).get("tenant", "")
        return (self.tenants.setdefault(tenant, len(self.tenants)), request.seq_no)


class CountingAdmitPolicy(FCFSPolicy):
    """Admits every other request it is asked about: hidden state."""

    def __init__(self, config):
        super().__init__(config)
        self.calls = 0

    def admit(self, request, state):
        self.calls += 1
        return self.calls % 2 == 1


def test_policy_contract_catches_a_policy_that_keeps_state():
    class FirstSeen(SchedulingPolicyContract):
        policy = FirstSeenTenantPolicy

    class Counting(SchedulingPolicyContract):
        policy = CountingAdmitPolicy

    with pytest.raises(AssertionError, match="keep no state"):
        FirstSeen().test_queue_order_does_not_depend_on_arrival_order_or_history()
    with pytest.raises(AssertionError, match="keep no state"):
        Counting().test_admit_is_pure_across_fresh_instances()


class FairSharePolicy(FCFSPolicy):
    """At most two running requests per tenant, counted from the state it is given."""

    name = "fair_share_test"

    def admit(self, request, state):
        tenant = (request.extra or {}).get("tenant")
        running = sum((r.extra or {}).get("tenant") == tenant for r in state.running)
        return running < 2


class TestFairSharePolicyContract(SchedulingPolicyContract):
    policy = FairSharePolicy


def test_a_fair_share_policy_sees_each_tenants_running_requests():
    kit = TestFairSharePolicyContract()
    config = kit.make_config()
    scheduler = DefaultScheduler(
        config, num_blocks=64, max_model_len=256, policy=FairSharePolicy(config)
    )
    for i in range(6):
        scheduler.add_request(
            kit.make_request(f"a{i}", 4, max_tokens=50, seq_no=i, extra={"tenant": "a"})
        )
    scheduler.add_request(kit.make_request("b0", 4, max_tokens=50, seq_no=6, extra={"tenant": "b"}))
    scheduler.schedule()
    tenants = sorted(r.extra["tenant"] for r in scheduler.running)
    assert tenants == ["a", "a", "b"]  # tenant a capped at two, b admitted past a's queue


class StatsMutator(LoggingStatLogger):
    def record(self, scheduler_stats, iteration_stats, engine_index=0):
        if iteration_stats is not None:
            iteration_stats.finished_requests.clear()


def test_stat_logger_contract_catches_a_logger_that_changes_the_stats():
    class Mutator(StatLoggerContract):
        stat_logger = StatsMutator

    with pytest.raises(AssertionError, match="must not change them"):
        Mutator().test_does_not_mutate_the_stats_it_receives()


KIT_USER = textwrap.dedent(
    """
    from enginecore.testing import SchedulingPolicyContract


    class TestFCFS(SchedulingPolicyContract):
        policy = "fcfs"


    def test_fixture_is_there(enginecore_config_overrides):
        assert enginecore_config_overrides == {}
    """
)


def _run_kit_user(tmp_path, args: tuple[str, ...], autoload: bool) -> subprocess.CompletedProcess:
    (tmp_path / "test_kit_user.py").write_text(KIT_USER)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    if not autoload:
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.mark.parametrize("autoload", [True, False])
def test_the_kit_loads_when_named_with_p(tmp_path, autoload):
    result = _run_kit_user(tmp_path, ("-p", "enginecore.testing"), autoload)
    assert result.returncode == 0, result.stdout + result.stderr
    assert " passed" in result.stdout and "failed" not in result.stdout


def test_the_kit_loads_from_a_conftest(tmp_path):
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["enginecore.testing"]\n')
    result = _run_kit_user(tmp_path, (), autoload=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert " passed" in result.stdout and "failed" not in result.stdout


def test_the_kit_is_not_loaded_into_every_pytest_run(tmp_path):
    """Installing enginecore adds nothing to another project's pytest: no ``pytest11``
    entry point, so the kit's fixtures exist only where the kit is named."""
    result = _run_kit_user(tmp_path, (), autoload=True)
    assert result.returncode != 0
    assert "fixture 'enginecore_config_overrides' not found" in result.stdout
    entry_points = importlib.metadata.entry_points(group="pytest11")
    assert not [ep for ep in entry_points if ep.value.startswith("enginecore")]


def test_loading_the_kit_imports_nothing_heavy():
    code = (
        "import sys, enginecore.testing; "
        "print(sorted(m for m in ('torch', 'transformers', 'enginecore.engine.llm') "
        "if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "[]"
