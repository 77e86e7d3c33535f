"""The built-in executors pass the conformance kit's ExecutorContract."""

from __future__ import annotations

from enginecore.testing import ExecutorContract


class TestUniExecutorContract(ExecutorContract):
    executor = "uni"
    world_size = 1


class TestMultiprocExecutorContract(ExecutorContract):
    executor = "mp"
    world_size = 2
