"""Settings that cannot be honoured are refused at start-up, as vLLM refuses them, naming
what would work; settings that do nothing on this device are said."""

from __future__ import annotations

import logging

import pytest

from enginecore import LLM
from enginecore.errors import ConfigError, EngineCoreError

#: A KV cache of three 16-token blocks of the tiny model: it holds 32 tokens.
SMALL_CACHE = 200_000


def test_a_context_length_the_cache_cannot_hold_is_refused_with_the_memory_needed(tiny_llama):
    # The engine sizes its cache and refuses in this process (the same start-up code as
    # in an engine process; tests/engine/test_engine_process.py carries a start-up
    # failure across the process boundary).
    with pytest.raises(EngineCoreError) as refused:
        LLM(
            model=str(tiny_llama),
            max_model_len=1024,
            kv_cache_bytes=SMALL_CACHE,
            multiprocessing=False,
        )
    message = str(refused.value)
    assert "max_model_len 1024 needs a KV cache of" in message
    assert "that memory holds max_model_len 32" in message
    assert "--kv-cache-bytes" in message and "lower --max-model-len" in message


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def started(tiny_llama):
    """``(llm, start-up warnings)`` of one engine for the two settings that start: no
    context length with a small cache, and a GPU memory setting on CPU (which changes
    nothing there, so it cannot change the fitted length either). The engine runs in
    this process: the fitted length is the engine's, as the handshake would carry it
    (tests/engine/test_engine_process.py checks the handshake)."""
    warnings = _Warnings()
    startup = logging.getLogger("enginecore.startup")
    startup.addHandler(warnings)
    level = startup.level
    startup.setLevel(logging.WARNING)
    try:
        with LLM(
            model=str(tiny_llama),
            device="cpu",
            gpu_memory_utilization=0.5,
            kv_cache_bytes=SMALL_CACHE,
            multiprocessing=False,
        ) as llm:
            yield llm, warnings.lines
    finally:
        startup.removeHandler(warnings)
        startup.setLevel(level)


def test_an_unset_context_length_is_fitted_to_the_cache(started):
    llm, _ = started
    assert llm.max_model_len == 32


def test_a_tensor_parallel_size_that_does_not_split_the_heads_fails_before_any_process(
    tiny_llama,
):
    with pytest.raises(ConfigError, match=r"tensor_parallel_size 3 cannot split this model") as e:
        LLM(model=str(tiny_llama), tensor_parallel_size=3)
    assert "sizes that work: 1, 2" in str(e.value)


def test_gpu_memory_utilization_on_cpu_is_said(started):
    _, warnings = started
    assert any("gpu_memory_utilization 0.5 has no effect on CPU" in w for w in warnings), warnings
