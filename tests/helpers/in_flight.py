"""Waiting until an ``LLM``'s requests are running in its engine, instead of sleeping."""

from __future__ import annotations

import time

from enginecore import LLM


def wait_until_generating(llm: LLM, count: int, timeout: float = 60.0) -> None:
    """Until ``count`` requests of ``llm`` (a ``generate`` call in another thread) are
    tracked and each has had a token back: the engine is running them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = list(llm.output_processor.states.values())
        if len(states) >= count and all(state.token_ids for state in states):
            return
        time.sleep(0.02)
    raise AssertionError(f"{count} requests were not generating within {timeout} s")
