"""``benchmarks/host_overhead.py --against``: the two checkouts take turns at running first,
so that the order of a round's runs does not pass for a difference between the codes."""

from __future__ import annotations

import importlib.util
import pathlib

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "host_overhead.py"


def _script():
    spec = importlib.util.spec_from_file_location("host_overhead", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_checkout_runs_first_in_half_the_rounds():
    variants = [("against", pathlib.Path("a"), "auto"), ("this", pathlib.Path("b"), "auto")]
    orders = [_script().in_turn(variants, i) for i in range(6)]
    firsts = [order[0][0] for order in orders]
    assert firsts.count("against") == firsts.count("this") == 3
    assert all(sorted(order) == sorted(variants) for order in orders)
