"""Fixtures the server tests share.

A server here is started once for the modules that only send it requests: none changes a
setting or the server's state that another one reads. Each module takes it through a
module-scoped fixture, which starts it again if an earlier module's test killed it.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.helpers.shared_server import COMPAT_MAX_MODEL_LEN, COMPAT_MAX_NEW_TOKENS, SharedServer


def _env_without_api_key() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "ENGINECORE_API_KEY"}


@pytest.fixture(scope="package")
def plain_server(tiny_llama, tmp_path_factory):
    """``enginecore serve`` of the tiny Llama with its defaults (float32, no API key), for
    the modules that only send it requests (beam search, Responses)."""
    flags = ["--max-model-len", "512", "--num-blocks-override", "200", "--dtype", "float32"]
    shared = SharedServer(
        tiny_llama, tmp_path_factory.mktemp("server-plain"), flags, _env_without_api_key()
    )
    yield shared
    shared.stop()


@pytest.fixture(scope="module")
def plain_server_url(plain_server) -> str:
    return plain_server.url()


@pytest.fixture(scope="package")
def compat_server(tiny_llama, tmp_path_factory):
    """``enginecore serve`` as the vLLM-compatibility and structured-output modules use it:
    a copy of the tiny Llama whose generation_config.json recommends
    ``COMPAT_MAX_NEW_TOKENS`` new tokens, ``--disable-any-whitespace`` (random weights would
    loop on spaces), no API key."""
    tmp = tmp_path_factory.mktemp("server-compat")
    checkpoint = tmp / "ckpt"
    shutil.copytree(tiny_llama, checkpoint)
    gen = json.loads((checkpoint / "generation_config.json").read_text())
    gen["max_new_tokens"] = COMPAT_MAX_NEW_TOKENS
    (checkpoint / "generation_config.json").write_text(json.dumps(gen))
    flags = ["--max-model-len", str(COMPAT_MAX_MODEL_LEN), "--num-blocks-override", "200"]
    flags.append("--disable-any-whitespace")
    shared = SharedServer(checkpoint, tmp, flags, _env_without_api_key())
    yield shared
    shared.stop()
