"""``--unknown-request-fields warn``: a field this server does not know is logged once per
name and ignored (vLLM's way), where the default (``reject``, see
test_server_vllm_compat.py) answers 400 naming it."""

from __future__ import annotations

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def warn_server(surface_server):
    """The server/ folder's ``surface_server``, started with ``--unknown-request-fields
    warn``: its URL and its log."""
    return surface_server.url(), surface_server.log_path


def test_unknown_fields_are_ignored_and_logged_once(warn_server):
    url, log_path = warn_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    for _ in range(2):
        out = client.completions.create(
            model=model,
            prompt="hi",
            max_tokens=2,
            extra_body={"vllm_xargs": {"a": 1}, "stream_options_extra": 1},
        )
        assert len(out.choices) == 1
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True, "future_option": True},
        extra_body={"vllm_xargs": {"a": 1}},
    )
    assert list(chat)[-1].usage.completion_tokens >= 1
    response = httpx.post(f"{url}/tokenize", json={"prompt": "hi", "add_bos": True})
    assert response.status_code == 200, response.text
    log = log_path.read_text()
    for name in ("vllm_xargs", "stream_options_extra", "future_option", "add_bos"):
        warnings = [line for line in log.splitlines() if "ignoring request field" in line]
        assert sum(f"'{name}'" in line for line in warnings) == 1, (name, warnings)


def test_known_fields_are_still_checked(warn_server):
    url, _ = warn_server
    body = {"prompt": "hi", "max_tokens": "many", "no_such_field": 1}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"
