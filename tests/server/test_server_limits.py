"""The request limits' scan (enginecore.server.limits), in-process: what it finds, and
that a body of many strings costs no more to scan than to parse (it runs on the event
loop: a 4 MiB list of stop strings held every endpoint, /health included)."""

from __future__ import annotations

import json
import time

import pytest

from enginecore import make_config
from enginecore.server.errors import APIError
from enginecore.server.limits import check_limits

LIMITS = make_config(model="unused").server


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "hi", "stop": ["ok", "\ud800"]},
        {"prompt": ["a", "b", "\udfff"]},
        {"prompt": "hi", "metadata": {"k": ["x", ["\ud83d"]]}},
    ],
)
def test_a_lone_surrogate_in_a_list_of_strings_is_a_400(body) -> None:
    with pytest.raises(APIError, match="lone surrogate"):
        check_limits(body, LIMITS)


def test_valid_strings_pass() -> None:
    check_limits({"prompt": ["a", "b\U0001f600"], "stop": ["x", "y"]}, LIMITS)


def _best_of(runs: int, fn) -> float:
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def test_scanning_many_strings_costs_less_than_parsing_them() -> None:
    raw = json.dumps({"prompt": "hi", "stop": [f"s{i}" for i in range(300_000)]})
    body = json.loads(raw)
    parse = _best_of(3, lambda: json.loads(raw))
    scan = _best_of(3, lambda: check_limits(body, LIMITS))
    assert scan < 1.5 * parse, (scan, parse)  # one Python call per string took ~3x
