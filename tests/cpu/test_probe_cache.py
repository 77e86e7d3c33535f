"""The packed GEMM's bit-exactness verdicts, kept on disk per weight shape."""

from __future__ import annotations

import json

import pytest
import torch

from enginecore_cpu import packed_gemm, panel_gemm, probe_cache


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGINECORE_CACHE_DIR", str(tmp_path))
    probe_cache.forget()
    yield tmp_path
    probe_cache.forget()


def test_verdicts_survive_a_new_process_state(cache_dir):
    assert probe_cache.lookup((1024, 576)) is None
    probe_cache.record((1024, 576), True)
    probe_cache.record((2048, 1024), False)
    probe_cache.forget()  # as a later start would
    assert probe_cache.lookup((1024, 576)) is True
    assert probe_cache.lookup((2048, 1024)) is False
    assert probe_cache.path().is_relative_to(cache_dir)


def test_switched_off_records_and_finds_nothing(cache_dir, monkeypatch):
    monkeypatch.setenv(probe_cache.ENV_SWITCH, "0")
    probe_cache.record((512, 64), True)
    assert probe_cache.lookup((512, 64)) is None
    assert not probe_cache.path().exists()


def test_a_corrupt_file_is_probed_again(cache_dir):
    probe_cache.path().parent.mkdir(parents=True)
    probe_cache.path().write_text("{not json")
    assert probe_cache.lookup((512, 64)) is None
    probe_cache.record((512, 64), True)
    assert json.loads(probe_cache.path().read_text()) == {"512x64": True}


@pytest.mark.skipif(
    packed_gemm.mkl() is None or panel_gemm.preferred(), reason="MKL's packed GEMM not used"
)
def test_pack_weights_probes_a_shape_once_and_then_trusts_the_file(cache_dir):
    weight = torch.randn(576, 1536).t()  # input-major [1536 out, 576 in]
    packed_gemm.pack_weights([weight])
    verdict = probe_cache.lookup(tuple(weight.shape))
    assert verdict is not None  # the first start probed and recorded it
    assert (weight._packed_gemm is not None) == verdict
    # A recorded "not the same bits" is obeyed without probing again.
    probe_cache.record(tuple(weight.shape), False)
    probe_cache.forget()
    assert packed_gemm.pack_weights([weight]) == 0
    assert weight._packed_gemm is None
