"""What a vLLM user's client still met differently from ``vllm serve``: ``logprob_token_ids``,
``stream_options.min_characters``, the prompt's ids in a chat stream's role chunks, and a
model served under several names, each through the real ``openai`` client (httpx where
the client hides the wire) against one real ``enginecore serve`` on a tiny random Llama."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest
import torch

from enginecore.config import make_config
from enginecore.errors import ConfigError
from enginecore.server.lora_models import LoRAModels
from tests.helpers.hf_reference import load_reference
from tests.helpers.shared_server import SURFACE_ALIAS, SURFACE_NAME

NAME, ALIAS = SURFACE_NAME, SURFACE_ALIAS
LISTED = [5, 17, 3]
USER = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def server(surface_server) -> str:
    """The server/ folder's ``surface_server`` (``NAME``, ``ALIAS``, an adapter)."""
    return surface_server.url()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def _events(server: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server}{path}", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    return [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]


def _error(response: httpx.Response) -> str:
    assert response.status_code == 400, response.text
    return response.json()["error"]["message"]


# --- 1. logprob_token_ids ------------------------------------------------------------------


def _reference_logprobs(path, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    """transformers' logprobs over the vocabulary at each generated position."""
    model = load_reference(str(path))
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids + token_ids[:-1]])).logits[0].float()
    return logits[len(prompt_ids) - 1 :].log_softmax(-1)


def test_completions_report_exactly_the_listed_ids(client, server, tiny_llama):
    """Each position: the listed ids (however unlikely) and the sampled token, with
    transformers' values; streamed alike."""
    out = client.completions.create(
        model=NAME, prompt="hello there", logprobs=0, temperature=0.0, max_tokens=4,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True,
                    "return_token_ids": True, "logprob_token_ids": LISTED},
    )  # fmt: skip
    choice = out.choices[0]
    tops = choice.logprobs.top_logprobs
    token_ids = choice.model_extra["token_ids"]
    reference = _reference_logprobs(tiny_llama, choice.model_extra["prompt_token_ids"], token_ids)
    assert len(tops) == 4
    for pos, (top, sampled) in enumerate(zip(tops, token_ids, strict=True)):
        assert set(top) == {f"token_id:{t}" for t in [*LISTED, sampled]}
        for key, value in top.items():
            expected = reference[pos, int(key.removeprefix("token_id:"))].item()
            assert math.isclose(value, expected, abs_tol=1e-4), key
    events = _events(
        server,
        "/v1/completions",
        {"model": NAME, "prompt": "hello there", "logprobs": 0, "temperature": 0.0,
         "max_tokens": 4, "ignore_eos": True, "return_tokens_as_token_ids": True,
         "stream": True, "logprob_token_ids": LISTED},
    )  # fmt: skip
    streamed = [top for e in events for top in e["choices"][0]["logprobs"]["top_logprobs"]]
    assert streamed == tops


def test_chat_top_logprobs_are_the_sampled_token_and_the_listed_ids(client):
    out = client.chat.completions.create(
        model=NAME, messages=USER, logprobs=True, top_logprobs=5, temperature=0.0,
        max_tokens=3, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True,
                                  "logprob_token_ids": LISTED},
    )  # fmt: skip
    content = out.choices[0].logprobs.content
    assert len(content) == 3
    for item in content:  # vLLM's: the sampled token, then the listed ids in their order
        listed = [f"token_id:{t}" for t in LISTED if f"token_id:{t}" != item.token]
        assert [t.token for t in item.top_logprobs] == [item.token, *listed]
        assert item.top_logprobs[0].logprob == item.logprob
        assert all(math.isfinite(t.logprob) and t.logprob <= 0 for t in item.top_logprobs)
    stream = client.chat.completions.create(
        model=NAME, messages=USER, logprobs=True, temperature=0.0, max_tokens=3, stream=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True,
                    "logprob_token_ids": LISTED},
    )  # fmt: skip
    items = [item for c in stream if c.choices and c.choices[0].logprobs
             for item in c.choices[0].logprobs.content]  # fmt: skip
    assert [[t.token for t in i.top_logprobs] for i in items] == [
        [t.token for t in i.top_logprobs] for i in content
    ]
    assert [i.logprob for i in items] == [i.logprob for i in content]


def test_logprob_token_ids_refusals_use_vllms_words(server):
    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{server}{path}", json={"model": NAME, **body}, timeout=60)

    completion = {"prompt": "hi", "max_tokens": 1, "logprobs": 0}
    outside = _error(post("/v1/completions", {**completion, "logprob_token_ids": [1, 99_999_999]}))
    assert "token_id(s) [99999999] in logprob_token_ids contain out-of-vocab token ids" in outside
    too_many = _error(post("/v1/completions", {**completion, "logprob_token_ids": [1] * 129}))
    assert "greater than max allowed: 128" in too_many
    unset = _error(post("/v1/completions", {"prompt": "hi", "logprob_token_ids": [1]}))
    assert "when using `logprob_token_ids`, `logprobs` must be set." in unset
    chat = _error(post("/v1/chat/completions", {"messages": USER, "logprob_token_ids": [1]}))
    assert "`logprobs` must be set" in chat
    beams = _error(post("/v1/completions", {**completion, "logprob_token_ids": [1],
                                            "use_beam_search": True, "n": 2}))  # fmt: skip
    assert "not supported with beam search" in beams


# --- 2. stream_options.min_characters ---------------------------------------------------------


def test_min_characters_holds_streamed_text_back(client, server):
    body = {"model": NAME, "prompt": "hello there", "max_tokens": 16, "temperature": 0.0,
            "ignore_eos": True}  # fmt: skip
    whole = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()["choices"][0]
    events = _events(
        server,
        "/v1/completions",
        {**body, "stream": True, "stream_options": {"min_characters": 12}},
    )
    texts = [e["choices"][0]["text"] for e in events if e["choices"]]
    assert "".join(texts) == whole["text"] and len(texts) >= 2
    assert all(len(t) >= 12 for t in texts[:-1])
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    chat = client.chat.completions.create(
        model=NAME, messages=USER, max_tokens=16, temperature=0.0, stream=True,
        stream_options={"min_characters": 12}, extra_body={"ignore_eos": True},  # type: ignore[typeddict-unknown-key]
    )  # fmt: skip
    pieces = [c.choices[0].delta.content for c in chat if c.choices and c.choices[0].delta.content]
    assert all(len(p) >= 12 for p in pieces[:-1]) and len("".join(pieces)) >= 12


# --- 3. prompt_token_ids in a chat stream's role chunks -----------------------------------------


def test_chat_stream_sends_the_prompt_ids_with_each_role_chunk(client, server):
    whole = client.chat.completions.create(
        model=NAME, messages=USER, max_tokens=2, extra_body={"return_token_ids": True}
    )
    prompt_ids = whole.model_extra["prompt_token_ids"]
    events = _events(
        server,
        "/v1/chat/completions",
        {"model": NAME, "messages": USER, "max_tokens": 2, "n": 2, "stream": True,
         "return_token_ids": True},
    )  # fmt: skip
    roles = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("role")]
    assert [e["choices"][0]["index"] for e in roles] == [0, 1]
    for event in roles:  # vLLM's order: the chunk's own fields, then the prompt's ids
        assert list(event) == ["id", "object", "created", "model", "choices", "prompt_token_ids"]
        assert event["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in e for e in events if e not in roles)
    assert all("token_ids" in e["choices"][0] for e in events if e not in roles and e["choices"])


# --- 4. several served names ------------------------------------------------------------------


def test_every_served_name_is_answered_and_the_first_reported(client, server):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == [NAME, ALIAS, "adapter"]
    assert cards["adapter"].parent == NAME
    out = client.completions.create(model=ALIAS, prompt="hi", max_tokens=1)
    assert out.model == NAME
    chat = client.chat.completions.create(model=ALIAS, messages=USER, max_tokens=1)
    assert chat.model == NAME
    tokens = httpx.post(f"{server}/tokenize", json={"model": ALIAS, "prompt": "hi"})
    assert tokens.status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="neither", prompt="hi", max_tokens=1)
    metrics = httpx.get(f"{server}/metrics").text
    assert f'model_name="{NAME}"' in metrics and f'model_name="{ALIAS}"' not in metrics


# --- 5. re-tried as a vLLM user: checked, kept as guards ----------------------------------------


def test_a_cut_inside_a_character_never_ends_in_a_replacement_character(client, server):
    """Byte-level tokens split an emoji over several tokens; ``max_tokens`` ending inside
    one holds the incomplete bytes back (vLLM's ``'🐱'``, never ``'🐱�'``), streamed or
    not, and a stop string cuts cleanly."""
    text = "🐱🐶"
    ids = httpx.post(
        f"{server}/tokenize", json={"model": NAME, "prompt": text, "add_special_tokens": False}
    ).json()["tokens"]
    assert len(ids) > 2
    forced = {"structured_outputs": {"choice": [text]}}
    for max_tokens in range(1, len(ids) + 1):
        request = {"model": NAME, "prompt": "Pets:", "max_tokens": max_tokens, "temperature": 0}
        whole = client.completions.create(**request, extra_body=forced).choices[0].text
        stream = client.completions.create(**request, stream=True, extra_body=forced)
        streamed = "".join(c.choices[0].text for c in stream if c.choices)
        assert "\ufffd" not in whole and text.startswith(whole) and streamed == whole
    stopped = client.completions.create(
        model=NAME, prompt="Pets:", max_tokens=16, temperature=0, stop=["🐶"], extra_body=forced
    ).choices[0]
    assert (stopped.text, stopped.finish_reason) == ("🐱", "stop")


# --- 6. vLLM routes with no counterpart -----------------------------------------------------


@pytest.mark.parametrize("path", ["/classify", "/v1/messages", "/start_profile", "/stop_profile"])
def test_vllm_routes_not_served_say_what_to_use(server, path):
    response = httpx.post(f"{server}{path}", json={})
    assert response.status_code == 501, response.text
    assert response.json()["error"]["message"].startswith(f"POST {path}: ")


def test_an_adapter_may_not_take_a_served_name(tiny_llama):
    config = make_config(
        model=str(tiny_llama), served_model_name=NAME, served_model_aliases=[ALIAS],
        enable_lora=True, lora_modules=[f"{ALIAS}=/nowhere"],
    )  # fmt: skip
    with pytest.raises(ConfigError, match="already served"):
        LoRAModels(config)
