"""Fixtures the server tests share.

One server here serves the modules that only send it requests: none changes a setting or
the server's state that another one reads, and none reads its log or metrics. Each module
takes it through a module-scoped fixture, which starts it again if an earlier module's
test killed it.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.helpers.shared_server import COMPAT_MAX_MODEL_LEN, COMPAT_MAX_NEW_TOKENS, SharedServer


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
