"""``enginecore bench decode``: single-stream decode beside its read bound, the bytes a
GGUF file's decode step reads counted against gguf's own reader (weights) and by hand from
the checkpoint's config (K/V at the run's mean context)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import pytest

from enginecore.bench import weight_bound
from tests.helpers.gguf_writer import write_gguf

gguf = pytest.importorskip("gguf")


def expected_bytes(path, experts: int = 0, used: int = 0) -> tuple[int, int]:
    """(bytes a step reads, bytes of the file's tensors), from gguf's own reader: every
    tensor, one embedding row (and all of it for a tied head), the routed experts' share."""
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    whole = sum(int(t.n_bytes) for t in tensors.values())
    reads = 0
    for name, tensor in tensors.items():
        size = int(tensor.n_bytes)
        if name == "token_embd.weight":
            reads += size // int(tensor.shape[-1])
            reads += 0 if "output.weight" in tensors else size
        elif "_exps." in name:
            reads += size * used // experts
        else:
            reads += size
    return reads, whole


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory, checkpoint_factory):
    return write_gguf(
        checkpoint_factory("llama"), tmp_path_factory.mktemp("gguf") / "q8.gguf", quantize=True
    )


def test_a_decode_step_reads_every_weight_and_one_embedding_row(llama_gguf):
    reads, whole = expected_bytes(llama_gguf)
    assert weight_bound.gguf_bytes_per_token(llama_gguf) == reads
    assert reads != whole  # the embedding is not read whole as a lookup table


def test_a_mixture_of_experts_reads_only_its_routed_share(tmp_path, checkpoint_factory):
    checkpoint = checkpoint_factory("qwen3_moe")
    path = write_gguf(checkpoint, tmp_path / "moe.gguf", quantize=True)
    config = json.loads((checkpoint / "config.json").read_text())
    experts = config.get("num_experts") or config["num_local_experts"]
    used = config["num_experts_per_tok"]
    assert 0 < used < experts
    reads, _ = expected_bytes(path, experts, used)
    assert weight_bound.gguf_bytes_per_token(path) == reads
    all_experts, _ = expected_bytes(path, 1, 1)
    assert reads < all_experts


def test_the_bound_is_bandwidth_over_bytes():
    bandwidth = weight_bound.measured_read_bandwidth(64 << 20, repeats=2)
    # A read of memory on any machine this runs on: between 100 MB/s and 10 TB/s.
    assert 1e8 < bandwidth < 1e13
    bound = weight_bound.Bound(weight_bytes=9 * 10**8, kv_bytes=10**8, bandwidth=bandwidth)
    assert bound.bytes_per_token == 10**9
    assert bound.tokens_per_s == pytest.approx(bandwidth / 1e9)


def test_the_bound_counts_the_kv_a_step_reads_at_the_mean_context(llama_gguf):
    meta = gguf.GGUFReader(str(llama_gguf)).fields
    layers = int(meta["llama.block_count"].contents())
    kv_heads = int(meta["llama.attention.head_count_kv"].contents())
    head_size = int(meta["llama.embedding_length"].contents()) // int(
        meta["llama.attention.head_count"].contents()
    )
    # 64 steps after a 32-token prompt attend over 33..96 positions: 64.5 on average;
    # each position holds a key and a value of every KV head in every layer, float32.
    by_hand = round(layers * kv_heads * 2 * head_size * 4 * 64.5)
    bound = weight_bound.gguf_decode_bound(llama_gguf, 32, 64, bandwidth=1e10)
    assert bound.kv_bytes == by_hand > 0
    assert bound.weight_bytes == weight_bound.gguf_bytes_per_token(llama_gguf)
    assert bound.bytes_per_token == bound.weight_bytes + by_hand
    half = weight_bound.gguf_decode_bound(llama_gguf, 32, 64, bandwidth=1e10, kv_itemsize=2)
    assert half.kv_bytes == by_hand // 2


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["auto", "float32"])
def test_bench_decode_reports_the_bound_beside_the_decode_speed(llama_gguf, tmp_path, kv):
    """With the KV cache in float16 (``auto`` for a GGUF file on CPU) the bound counts
    two bytes a K/V element; in float32, four."""
    out = tmp_path / "decode.json"
    command = [sys.executable, "-m", "enginecore.cli", "bench", "decode", str(llama_gguf)]
    command += ["--input-len", "8", "--output-len", "8", "--rounds", "1", "--kv-cache-dtype", kv]
    proc = subprocess.run(
        [*command, "--output-json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    itemsize = 4 if kv == "float32" else 2
    expected = weight_bound.gguf_decode_bound(
        llama_gguf, 8, 8, result["bandwidth_bytes_per_s"], kv_itemsize=itemsize
    )
    assert result["kv_cache_dtype"] == kv
    assert result["weight_bytes_per_token"] == expected.weight_bytes
    assert result["kv_bytes_per_token"] == expected.kv_bytes > 0
    assert result["bytes_per_token"] == expected.bytes_per_token
    assert result["decode_tokens_per_s"] > 0
    assert result["bound_tokens_per_s"] == pytest.approx(
        result["bandwidth_bytes_per_s"] / result["bytes_per_token"]
    )
    assert result["fraction_of_bound"] == pytest.approx(
        result["decode_tokens_per_s"] / result["bound_tokens_per_s"]
    )
    assert "read bound" in proc.stdout and "MB of K/V" in proc.stdout and "% of it" in proc.stdout


def test_a_stall_outside_the_requests_decode_does_not_enter_the_speed(
    llama_gguf, monkeypatch, tmp_path
):
    """A process paused between or around requests (another program taking the core, the
    prefill) does not enter the decode figure: it is timed from the request's own tokens.
    Timed as one request's wall time less another's, every second call stalled gave a
    difference at or below zero, reported as billions of tokens a second."""
    from enginecore import LLM
    from enginecore.bench import decode

    generate = LLM.generate
    calls = []

    def stalled_every_second_call(self, *args, **kwargs):
        calls.append(None)
        if len(calls) % 2:
            time.sleep(0.5)
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(LLM, "generate", stalled_every_second_call)
    parser = argparse.ArgumentParser()
    decode.add_arguments(parser)
    out = tmp_path / "decode.json"
    args = parser.parse_args(
        [str(llama_gguf), "--input-len", "8", "--output-len", "8", "--output-json", str(out)]
    )
    assert decode.run(args) == 0
    speeds = json.loads(out.read_text())["rounds"]
    assert len(speeds) == 3
    # Eight steps of an engine whose step is Python take well over 10 us each.
    assert all(0 < speed < 1e5 for speed in speeds), speeds
