"""The engine's hand-off of a step to the ``uni`` executor's worker thread, alone.

A worker whose ``execute_model`` marks its inputs staged and returns, and whose
``sample_tokens`` returns at once; each step is launched, its staged inputs waited for
and its output read, as the async loop does. ``one``: the executor's one call per step
(``UniProcExecutor._launch_step``); ``two``: the two calls of the ``Executor`` base class
(``execute_model`` then ``sample_tokens``, each through ``collective_rpc``).

Run under callgrind at two step counts; the difference of the instruction counts over
the difference of the steps is the instructions per step, whatever the machine's load:

    valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python benchmarks/handoff_instructions.py one 200
    valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python benchmarks/handoff_instructions.py one 1200
"""

from __future__ import annotations

import argparse
from typing import Any

from enginecore import make_config
from enginecore.engine.core import EngineCore
from enginecore.engine.inputs_staged import mark_inputs_staged
from enginecore.engine.serial_thread import SerialThread
from enginecore.interfaces import Executor
from enginecore_executors.uniproc import UniProcExecutor


class _Worker:
    rank = 0

    def resolve_method(self, name: str) -> Any:
        return getattr(self, name)

    def execute_model(self, scheduler_output: Any) -> None:
        mark_inputs_staged()

    def sample_tokens(self, grammar_output: Any) -> str:
        return "sampled"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("way", choices=("one", "two"))
    parser.add_argument("steps", type=int)
    args = parser.parse_args()
    executor = UniProcExecutor.__new__(UniProcExecutor)  # no model: the worker above
    executor.config = make_config(model="none")
    executor.worker = _Worker()
    executor._thread = SerialThread("enginecore-uni")
    executor.inputs_staged = None
    executor.__dict__["kv_output_aggregator"] = None  # one rank
    launch = executor._launch_step if args.way == "one" else executor_base_launch(executor)
    try:
        for _ in range(args.steps):
            execute, sample = launch(None, None)
            assert executor.inputs_staged is not None
            executor.inputs_staged.wait()
            assert EngineCore._result(execute, sample) == "sampled"
    finally:
        executor._thread.shutdown()


def executor_base_launch(executor: UniProcExecutor) -> Any:
    """The base class's launch: the two halves as two calls."""
    return lambda scheduler_output, grammar: Executor._launch_step(
        executor, scheduler_output, grammar
    )


if __name__ == "__main__":
    main()
