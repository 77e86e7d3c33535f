"""Fixtures the engine tests share."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from enginecore import LLM

#: The shared engine's KV cache: 16 blocks of 16 tokens of the tiny Llama (4 layers, 2 KV
#: heads of 64 float32 values), few enough that a dozen requests preempt one another.
SMALL_KV_CACHE_BYTES = 16 * 16 * 4 * 2 * 2 * 64 * 4


@pytest.fixture(scope="package")
def async_tiny_llm(tiny_llama: pathlib.Path) -> Iterator[LLM]:
    """One in-process engine with async scheduling over the tiny Llama, for the tests
    that look inside a step (restore what you patch: ``monkeypatch``)."""
    with LLM(
        tiny_llama,
        dtype="float32",
        multiprocessing=False,
        async_scheduling=True,
        max_model_len=64,
        kv_cache_bytes=SMALL_KV_CACHE_BYTES,
        log_stats_interval=0,
    ) as llm:
        yield llm
