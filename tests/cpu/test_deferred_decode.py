"""The stand-in for the fused decode step while its library compiles takes every
argument the step takes: the runner calls one or the other through the same call, and
an argument the stand-in lacks fails every decode step of a first start once the
library lands (``tests/cpu/test_first_load.py`` runs that start, slowly)."""

from __future__ import annotations

import inspect

from enginecore_cpu.decode_step import FusedDecodeStep
from enginecore_cpu.deferred_decode import DeferredDecodeStep


def test_the_stand_in_runs_with_every_argument_the_fused_step_takes():
    step = inspect.signature(FusedDecodeStep.run).parameters
    stand_in = inspect.signature(DeferredDecodeStep.run).parameters
    assert list(stand_in) == list(step)
    assert [p.default for p in stand_in.values()] == [p.default for p in step.values()]
