"""The CPU backend's whole-step decode kernel stays off with LoRA (its C loop has no
point between projections to add the adapters' delta): the engine says so once, naming
the backend, and decode steps run layer by layer."""

from __future__ import annotations

import logging

import pytest

from enginecore.config import make_config
from enginecore.engine.core import EngineCore
from enginecore_models import lora_support

pytest.importorskip("peft")


def test_lora_says_once_why_the_fused_decode_step_is_off(tiny_llama, caplog, monkeypatch):
    monkeypatch.setattr(lora_support, "_fused_decode_noted", False)  # once per process
    config = make_config(
        model=str(tiny_llama),
        dtype="float32",
        executor="uni",
        attention_backend="cpu",
        enable_lora=True,
        num_blocks_override=64,
    )
    with caplog.at_level(logging.INFO, logger="enginecore_models.lora_support"):
        core = EngineCore(config)
    try:
        runner = core.executor.worker.model_runner
        assert runner.fused_decode is None
        notes = [
            r.getMessage() for r in caplog.records if "fused decode step is off" in r.getMessage()
        ]
        assert len(notes) == 1, notes
        assert "CpuAttentionBackend" in notes[0] and "layer by layer" in notes[0]
    finally:
        core.shutdown()
