"""The built-in scheduling policies, the waiting queue, and their registration."""

from __future__ import annotations

from enginecore import make_config
from enginecore.interfaces import SchedulerState, SchedulingPolicy
from enginecore.registry import Registry
from enginecore_schedulers import plugin
from enginecore_schedulers.policies import FairSharePolicy, FCFSPolicy, PriorityPolicy
from enginecore_schedulers.waiting_queue import WaitingQueue
from tests.helpers.scheduler import make_request

CONFIG = make_config(model="fake")


def reqs(*specs: tuple[str, int, int]):
    """(id, seq_no, priority) triples."""
    return [make_request(rid, [1], seq_no=seq, priority=prio) for rid, seq, prio in specs]


def test_fcfs_orders_by_seq_no_and_preempts_the_latest():
    policy = FCFSPolicy(CONFIG)
    assert isinstance(policy, SchedulingPolicy) and policy.name == "fcfs"
    a, b, c = reqs(("a", 5, 0), ("b", 1, 9), ("c", 3, -9))
    assert sorted([a, b, c], key=policy.sort_key) == [b, c, a]  # priority is ignored
    assert policy.pick_preemption_victim([b, a, c]) is a


def test_priority_orders_by_priority_then_arrival():
    policy = PriorityPolicy(CONFIG)
    assert policy.name == "priority"
    a, b, c, d = reqs(("a", 0, 1), ("b", 1, 0), ("c", 2, 0), ("d", 3, 1))
    assert sorted([d, c, b, a], key=policy.sort_key) == [b, c, a, d]
    # Victim: the lowest priority (highest value), the latest arrival among equals.
    assert policy.pick_preemption_victim([a, b, c, d]) is d
    assert policy.pick_preemption_victim([a, b, c]) is a
    assert policy.pick_preemption_victim([b, c]) is c


def test_priority_with_equal_priorities_matches_fcfs():
    fcfs, prio = FCFSPolicy(CONFIG), PriorityPolicy(CONFIG)
    rs = reqs(("a", 4, 0), ("b", 2, 0), ("c", 9, 0), ("d", 1, 0))
    assert sorted(rs, key=fcfs.sort_key) == sorted(rs, key=prio.sort_key)
    assert fcfs.pick_preemption_victim(rs) is prio.pick_preemption_victim(rs)


def test_default_admit_accepts():
    state = SchedulerState(
        num_running=0,
        num_waiting=1,
        num_free_blocks=9,
        num_total_blocks=9,
        token_budget_left=10,
        step=1,
    )
    for policy in (FCFSPolicy(CONFIG), PriorityPolicy(CONFIG)):
        assert policy.admit(make_request("x", [1]), state) is True


def test_waiting_queue_pops_in_policy_order_and_requeues_at_the_front():
    queue = WaitingQueue(PriorityPolicy(CONFIG).sort_key)
    a, b, c = reqs(("a", 0, 2), ("b", 1, 0), ("c", 2, 0))
    for r in (a, b, c):
        queue.push(r)
    assert [r.request_id for r in queue] == ["b", "c", "a"]
    assert queue.peek() is b and queue.pop() is b
    queue.push(b)  # a preempted request goes back by its own key: the front
    assert queue.peek() is b
    queue.remove_many({id(c)})
    assert [r.request_id for r in queue] == ["b", "a"] and len(queue) == 2


def test_plugin_registers_default_scheduler_and_policies_lazily():
    schedulers: Registry = Registry("scheduler")
    policies: Registry = Registry("scheduling_policy")
    plugin.register_schedulers(schedulers)
    plugin.register_scheduling_policies(policies)
    entry = schedulers.entry("default")
    assert entry.factory == "enginecore_schedulers.scheduler:DefaultScheduler"
    assert entry.summary
    assert policies.names() == ["fair_share", "fcfs", "priority"]
    assert policies.get("fcfs") is FCFSPolicy
    assert policies.get("priority") is PriorityPolicy
    from enginecore_schedulers.scheduler import DefaultScheduler

    assert schedulers.get("default") is DefaultScheduler
    assert DefaultScheduler.supports_async_scheduling


def test_plugin_hooks_are_trylast_hookimpls():
    for fn in (plugin.register_schedulers, plugin.register_scheduling_policies):
        opts = fn.enginecore_impl  # type: ignore[attr-defined]  # set by the hookimpl marker
        assert opts["trylast"] is True


def test_fair_share_interleaves_clients_by_their_rank():
    """A client with six requests queued first, then one request each from two other
    clients: each newcomer ranks 0 and goes right after the flood's first request, not
    behind all six. A rank that is not a non-negative integer counts as 0."""
    policy = FairSharePolicy(make_config(model="x"))
    flood = [make_request(f"a{i}", [1], seq_no=i, extra={"client_rank": i}) for i in range(6)]
    b = make_request("b0", [1], seq_no=6, extra={"client_rank": 0})
    c = make_request("c0", [1], seq_no=7, extra={"client_rank": 0})
    offline = make_request("offline", [1], seq_no=8)  # no rank: like FCFS among rank 0
    bogus = make_request("bogus", [1], seq_no=9, extra={"client_rank": -5})
    queue = WaitingQueue(policy.sort_key)
    for request in [*flood, b, c, offline, bogus]:
        queue.push(request)
    order = [queue.pop().request_id for _ in range(len(queue))]
    assert order == ["a0", "b0", "c0", "offline", "bogus", "a1", "a2", "a3", "a4", "a5"]
    assert policy.pick_preemption_victim([flood[0], flood[5], b]) is flood[5]
