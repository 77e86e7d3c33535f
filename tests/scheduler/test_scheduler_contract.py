"""The built-in scheduler and policies pass the conformance kit's contracts."""

from __future__ import annotations

from enginecore.testing import SchedulerContract, SchedulingPolicyContract


class TestDefaultSchedulerContract(SchedulerContract):
    scheduler = "default"


class TestDefaultSchedulerWithoutChunkedPrefill(SchedulerContract):
    scheduler = "default"
    config_overrides = {"chunked_prefill": False, "max_num_batched_tokens": 128}
    max_num_batched_tokens = 128


class TestFCFSPolicyContract(SchedulingPolicyContract):
    policy = "fcfs"


class TestPriorityPolicyContract(SchedulingPolicyContract):
    policy = "priority"
