"""Fixtures the server tests share."""

from __future__ import annotations

import os

import pytest

from tests.helpers.serve_process import serve, stop


@pytest.fixture(scope="package")
def plain_server_url(tiny_llama, tmp_path_factory):
    """``enginecore serve`` of the tiny Llama with its defaults (float32, no API key),
    started once for the modules that only send it requests (beam search, Responses):
    none changes a setting or the server's state that another one reads. Stopped when
    the folder's tests are done."""
    log_path = tmp_path_factory.mktemp("server-plain") / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "ENGINECORE_API_KEY"}
    flags = ["--max-model-len", "512", "--num-blocks-override", "200", "--dtype", "float32"]
    proc, url = serve(tiny_llama, log_path, *flags, env=env)
    yield url
    stop(proc)
