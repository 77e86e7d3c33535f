"""Fixtures the server tests share.

One server here (``compat_server``) serves the modules that only send it requests: none changes a setting or
the server's state that another one reads, and none reads its log or metrics. Each module
takes it through a module-scoped fixture, which starts it again if an earlier module's
test killed it. ``surface_server`` and ``guarded_server`` each serve two modules whose
flags do not get in each other's way (one start for both).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from enginecore.lora.random_adapter import make_random_adapter
from tests.helpers.shared_server import (
    COMPAT_MAX_MODEL_LEN,
    COMPAT_MAX_NEW_TOKENS,
    GUARDED_MAX_PENDING,
    GUARDED_MAX_PROMPT_TOKENS,
    SURFACE_ALIAS,
    SURFACE_NAME,
    SharedServer,
)


@pytest.fixture(scope="package")
def compat_server(tiny_llama, tmp_path_factory):
    """``enginecore serve`` of a copy of the tiny Llama whose generation_config.json
    recommends ``COMPAT_MAX_NEW_TOKENS`` new tokens, otherwise as ``vllm serve`` users run
    it (float32 on CPU, no API key), with ``--disable-any-whitespace`` (random weights
    would loop on spaces in structured output). Every module but vLLM-compat's names the
    tokens it wants, so the recommendation reaches only the test that checks it."""
    tmp = tmp_path_factory.mktemp("server-compat")
    checkpoint = tmp / "ckpt"
    shutil.copytree(tiny_llama, checkpoint)
    gen = json.loads((checkpoint / "generation_config.json").read_text())
    gen["max_new_tokens"] = COMPAT_MAX_NEW_TOKENS
    (checkpoint / "generation_config.json").write_text(json.dumps(gen))
    flags = ["--max-model-len", str(COMPAT_MAX_MODEL_LEN), "--num-blocks-override", "200"]
    flags.append("--disable-any-whitespace")
    env = {k: v for k, v in os.environ.items() if k != "ENGINECORE_API_KEY"}
    shared = SharedServer(checkpoint, tmp, flags, env)
    yield shared
    shared.stop()


@pytest.fixture(scope="module")
def plain_server_url(compat_server) -> str:
    """The shared server's URL, for the modules that need nothing but requests (beam
    search, Responses)."""
    return compat_server.url()


@pytest.fixture(scope="package")
def surface_server(tiny_llama, tmp_path_factory):
    """``enginecore serve`` of the tiny Llama under two names with an adapter, every
    logprob allowed, and ``--unknown-request-fields warn``: the vLLM-surface module sends
    it only fields it knows, and the unknown-fields module reads the warnings in its log
    (each field name it sends is its own, so each is warned about first there)."""
    tmp = tmp_path_factory.mktemp("server-openai-surface")
    adapter = make_random_adapter(tiny_llama, tmp / "adapter", r=4, seed=1)
    flags = [
        "--max-model-len", "256", "--num-blocks-override", "128", "--max-logprobs", "-1",
        "--served-model-name", SURFACE_NAME, SURFACE_ALIAS, "--enable-lora",
        "--max-lora-rank", "8", "--lora-modules", f"adapter={adapter}",
        "--unknown-request-fields", "warn",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "ENGINECORE_API_KEY"}
    shared = SharedServer(tiny_llama, tmp, flags, env)
    yield shared
    shared.stop()


@pytest.fixture(scope="package")
def guarded_server(tiny_llama, tmp_path_factory):
    """``enginecore serve`` of the tiny Llama with the request limits the hardening module
    attacks (``GUARDED_MAX_PROMPT_TOKENS`` prompt tokens per request, ``GUARDED_MAX_PENDING``
    requests admitted at once), sleep mode and the dev endpoints, and the vLLM-parity
    module's flags: every logprob allowed, usage in every stream, ``/load`` tracked. The
    hardening module stops and pauses the engine only within a test and leaves it serving;
    the parity module never sends more than ``GUARDED_MAX_PENDING`` requests at once, and
    its streams are the only ones read to the end."""
    tmp = tmp_path_factory.mktemp("server-guarded")
    flags = [
        "--enable-sleep-mode", "--enable-dev-endpoints", "--dtype", "float32",
        "--max-model-len", "2048",
        "--max-prompt-tokens-per-request", str(GUARDED_MAX_PROMPT_TOKENS),
        "--max-pending-requests", str(GUARDED_MAX_PENDING), "--stat-loggers", "",
        "--max-logprobs", "-1", "--enable-force-include-usage",
        "--enable-server-load-tracking",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "ENGINECORE_API_KEY"}
    shared = SharedServer(tiny_llama, tmp, flags, env)
    yield shared
    shared.stop()
