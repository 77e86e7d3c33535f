"""A `vllm serve` command line and a vLLM client's control calls: each vLLM flag spelling
works here or is refused naming our equivalent, flags are never abbreviated, an unknown
flag gets the closest ones, and the control routes are opt-in as vLLM's are."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from enginecore import make_config, vllm_flags
from enginecore.cli import build_parser, main
from enginecore.server.app import build_app
from tests.helpers.dead_engine import DeadEngine


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "enginecore.cli", *args], capture_output=True, text=True, timeout=120
    )


def _main(*args: str) -> tuple[int, str, str]:
    """``enginecore ARGS`` through the command's ``main`` in this process (the command
    line is the subject, not an interpreter start): exit status, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def _config_show(tiny_llama, *flags: str) -> dict:
    code, out, err = _main("config", "show", "--model", str(tiny_llama), *flags, "--format", "json")
    assert code == 0, err
    return json.loads(out)


def test_vllm_flag_spellings_set_our_settings(tiny_llama):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}
    config = _config_show(
        tiny_llama,
        "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
        "--distributed-executor-backend", "uni", "--disable-log-requests",
        "--disable-log-stats", "--guided-decoding-backend", "auto",
        "--kv-cache-dtype", "auto", "--trust-remote-code",
        "--speculative-config", json.dumps(spec), "--served-model-name", "mine",
        "--enable-sleep-mode",
    )  # fmt: skip
    assert config["cache"]["prefix_caching"] is False
    assert config["scheduler"]["chunked_prefill"] is False
    assert config["parallel"]["executor"] == "uni"
    assert config["observability"]["log_requests"] is False
    assert config["observability"]["stat_loggers"] == []
    assert config["structured_output"]["backend"] == "xgrammar"
    assert config["speculative"]["speculative_method"] == "ngram"
    assert config["speculative"]["num_speculative_tokens"] == 3
    assert config["speculative"]["ngram_prompt_lookup_max"] == 5
    assert config["model"]["served_model_name"] == "mine"
    assert config["server"]["enable_sleep_mode"] is True
    assert _config_show(tiny_llama, "--enable-prefix-caching")["cache"]["prefix_caching"] is True
    kv = {"kv_connector": "shared_storage", "kv_role": "kv_both"}
    kv["kv_connector_extra_config"] = {"path": "/kv"}
    more = _config_show(
        tiny_llama, "-tp", "2", "--max-model-len", "1K", "--kv-cache-memory-bytes", "1000000",
        "--num-gpu-blocks-override", "64", "--kv-transfer-config", json.dumps(kv),
    )  # fmt: skip
    assert more["parallel"]["tensor_parallel_size"] == 2
    assert more["model"]["max_model_len"] == 1024
    assert more["cache"]["kv_cache_bytes"] == 1_000_000
    assert more["cache"]["num_blocks_override"] == 64
    assert more["kv_transfer"] == {
        "connector": "shared_storage",
        "role": "kv_both",
        "extra_config": {"path": "/kv"},
    }
    assert _config_show(tiny_llama, "--runner", "generate")["model"]["runner"] == "torch"
    dp = _config_show(tiny_llama, "--data-parallel-address", "10.0.0.5")
    assert dp["parallel"]["data_parallel_host"] == "10.0.0.5"
    fitted = _config_show(tiny_llama, "--max-model-len", "auto")
    assert fitted["model"]["max_model_len"] is None


def test_structured_outputs_config_is_read(tiny_llama):
    spec = {"backend": "auto", "disable_any_whitespace": True}
    config = _config_show(tiny_llama, "--structured-outputs-config", json.dumps(spec))
    assert config["structured_output"]["backend"] == "xgrammar"
    assert config["structured_output"]["disable_any_whitespace"] is True


def test_several_served_model_names_are_vllms_first_name_and_aliases(tiny_llama):
    config = _config_show(tiny_llama, "--served-model-name", "a", "b", "c")
    assert config["model"]["served_model_name"] == "a"
    assert config["model"]["served_model_aliases"] == ["b", "c"]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--kv-cache-dtype", "fp8"], "float16"),
        (["--speculative-config", '{"model": "draft", "num_speculative_tokens": 2}'], "ngram"),
        (["--scheduler-cls", "pkg.MyScheduler"], "--scheduler-name"),
    ],
)
def test_vllm_flags_without_an_equivalent_are_refused_naming_ours(tiny_llama, flags, named):
    code, _, err = _main("config", "show", "--model", str(tiny_llama), *flags)
    assert code == 2 and named in err, err


def test_flags_are_never_abbreviated_and_unknown_ones_get_a_suggestion(tiny_llama):
    done = _cli("config", "show", "--model", str(tiny_llama), "--max-num-s", "32")
    assert done.returncode == 2
    assert "unrecognized arguments: --max-num-s" in done.stderr
    assert "Did you mean '--max-num-seqs'" in done.stderr


@pytest.fixture
def config(tmp_path):
    return make_config(model=str(tmp_path), stat_loggers=[], allowed_hosts=["testserver"])


def test_control_routes_are_opt_in_and_their_absence_names_the_flag(config):
    with TestClient(build_app(config, DeadEngine())) as client:
        for method, path, flag in (
            ("post", "/sleep?level=1", "--enable-sleep-mode"),
            ("post", "/wake_up", "--enable-sleep-mode"),
            ("get", "/is_sleeping", "--enable-sleep-mode"),
            ("post", "/pause", "--enable-dev-endpoints"),
            ("post", "/resume", "--enable-dev-endpoints"),
            ("post", "/reset_prefix_cache", "--enable-dev-endpoints"),
        ):
            response = getattr(client, method)(path)
            assert response.status_code == 404, path
            assert flag in response.json()["error"]["message"], path


def test_vllms_dev_mode_variable_turns_the_dev_routes_on(config, monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    with TestClient(build_app(config, DeadEngine()), raise_server_exceptions=False) as client:
        # Served (the stand-in engine has no pause): no longer the 404 naming the flag.
        response = client.post("/pause")
        assert response.status_code != 404


def test_audio_routes_say_what_is_missing(config):
    with TestClient(build_app(config, DeadEngine())) as client:
        for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
            response = client.post(path, json={})
            assert response.status_code == 501
            assert "audio models are not supported" in response.json()["error"]["message"]


MIGRATION = Path(__file__).resolve().parents[2] / "docs" / "vllm_migration.md"


def test_the_migration_page_names_every_vllm_spelling_and_only_real_flags():
    text = MIGRATION.read_text()
    spellings = [
        *vllm_flags.SWITCHES, *vllm_flags.ACCEPTED_AS_IS, *vllm_flags.WITH_VALUE,
        *vllm_flags.REFUSED,
    ]  # fmt: skip
    assert [s for s in spellings if f"`{s}" not in text] == []
    alike = text.split("Spelled alike (same meaning):", 1)[1].split("\n\n", 1)[0]
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    ours = {flag for action in serve._actions for flag in action.option_strings}
    claimed = re.findall(r"`(--[a-z-]+)", alike)
    assert claimed and [flag for flag in claimed if flag not in ours] == []


@pytest.mark.parametrize("value", ["auto", "float32", "float16", "bfloat16"])
def test_the_kv_cache_dtype_flag_sets_the_caches_dtype(tiny_llama, value):
    """vLLM's ``--kv-cache-dtype`` and ours are one flag; ``auto`` is the default."""
    assert _config_show(tiny_llama)["cache"]["kv_cache_dtype"] == "auto"
    config = _config_show(tiny_llama, "--kv-cache-dtype", value)
    assert config["cache"]["kv_cache_dtype"] == value
