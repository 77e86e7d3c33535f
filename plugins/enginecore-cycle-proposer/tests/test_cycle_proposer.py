"""Tests of the cycle proposer. Run with the package installed (``pip install -e .``)."""

from __future__ import annotations

import numpy as np
from enginecore_cycle_proposer import CycleProposer

from enginecore import make_config
from enginecore.plugins import make_plugin_manager
from enginecore.testing import SpecDecodeProposerContract


def propose(tokens: list[int], k: int = 5) -> list[int]:
    config = make_config(speculative_method="cycle", num_speculative_tokens=k)
    return CycleProposer(config).propose(np.array(tokens, dtype=np.int64), k)


def test_continues_the_shortest_cycle_beyond_the_text():
    assert propose([9, 1, 2, 3, 1, 2, 3]) == [1, 2, 3, 1, 2]
    assert propose([4, 7, 7]) == [7, 7, 7, 7, 7]
    assert propose([1, 2, 1, 2, 1, 2], k=3) == [1, 2, 1]


def test_no_cycle_no_drafts():
    assert propose([1, 2, 3, 4, 5]) == []
    assert propose([1]) == []


def test_registered_under_its_name():
    registry = make_plugin_manager().registry("spec_decode_proposer")
    assert registry.entry("cycle").plugin == "cycle_proposer"
    assert registry.get("cycle") is CycleProposer


class TestCycleProposerContract(SpecDecodeProposerContract):
    """enginecore's conformance kit, run against this plugin."""

    proposer = "cycle"
