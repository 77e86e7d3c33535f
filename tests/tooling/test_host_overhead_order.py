"""``benchmarks/host_overhead.py --against``: the two checkouts take turns at running first,
so that the order of a round's runs does not pass for a difference between the codes."""

from __future__ import annotations

import pathlib

from tests.helpers.script_module import load_script


def test_each_checkout_runs_first_in_half_the_rounds():
    variants = [("against", pathlib.Path("a"), "auto"), ("this", pathlib.Path("b"), "auto")]
    orders = [load_script("benchmarks/host_overhead.py").in_turn(variants, i) for i in range(6)]
    firsts = [order[0][0] for order in orders]
    assert firsts.count("against") == firsts.count("this") == 3
    assert all(sorted(order) == sorted(variants) for order in orders)
