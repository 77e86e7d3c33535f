"""``use_beam_search`` through a real ``enginecore serve`` and the real ``openai`` client,
against transformers' ``generate(num_beams=...)`` (no beam ends: ``ignore_eos``, where
transformers and vLLM define beam search alike; see test_beam_search.py for EOS)."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.helpers.hf_reference import load_reference

PROMPT = "The quick brown fox jumps over the lazy dog"
USER = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def server_url(plain_server_url):
    return plain_server_url


@pytest.fixture(scope="module")
def client(server_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def hf_beams(path, prompt_ids: list[int], width: int, max_tokens: int) -> list[list[int]]:
    """transformers' ``width`` beams' generated tokens, best first."""
    generated = load_reference(str(path)).generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        max_new_tokens=max_tokens,
        early_stopping=True,
        eos_token_id=None,
        pad_token_id=0,
    )
    return [row[len(prompt_ids) :].tolist() for row in generated]


def _tokens(url: str, **body) -> list[int]:
    response = httpx.post(f"{url}/tokenize", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_completions_beams_match_transformers(client, model, server_url, tiny_llama):
    out = client.completions.create(
        model=model,
        prompt=PROMPT,
        n=3,
        max_tokens=6,
        extra_body={"use_beam_search": True, "ignore_eos": True, "return_token_ids": True},
    )
    expected = hf_beams(tiny_llama, _tokens(server_url, prompt=PROMPT), 3, 6)
    choices = sorted(out.choices, key=lambda c: c.index)
    assert [c.model_dump()["token_ids"] for c in choices] == expected
    assert all(c.finish_reason == "length" for c in choices)
    assert out.usage.completion_tokens == 3 * 6


def test_best_of_is_the_beam_width(client, model, server_url, tiny_llama):
    out = client.completions.create(
        model=model,
        prompt=PROMPT,
        n=1,
        best_of=4,
        max_tokens=5,
        extra_body={"use_beam_search": True, "ignore_eos": True, "return_token_ids": True},
    )
    (best, *_) = hf_beams(tiny_llama, _tokens(server_url, prompt=PROMPT), 4, 5)
    assert len(out.choices) == 1
    assert out.choices[0].model_dump()["token_ids"] == best


@pytest.mark.parametrize("stream", [False, True])
def test_chat_beams_match_transformers(client, model, server_url, tiny_llama, stream):
    prompt_ids = _tokens(server_url, messages=USER)
    expected = hf_beams(tiny_llama, prompt_ids, 2, 5)
    tokenizer_text = [
        httpx.post(f"{server_url}/detokenize", json={"tokens": ids}).json()["prompt"]
        for ids in expected
    ]
    extra = {"use_beam_search": True, "ignore_eos": True}
    if not stream:
        out = client.chat.completions.create(
            model=model, messages=USER, n=2, max_tokens=5, extra_body=extra
        )
        texts = [c.message.content for c in sorted(out.choices, key=lambda c: c.index)]
    else:
        chunks = client.chat.completions.create(
            model=model, messages=USER, n=2, max_tokens=5, stream=True, extra_body=extra
        )
        parts: dict[int, str] = {0: "", 1: ""}
        for chunk in chunks:
            for choice in chunk.choices:
                parts[choice.index] += choice.delta.content or ""
        texts = [parts[0], parts[1]]
    assert texts == tokenizer_text


def test_completions_stream_sends_the_beams(client, model):
    body = {"use_beam_search": True, "ignore_eos": True}
    whole = client.completions.create(
        model=model, prompt=PROMPT, n=2, max_tokens=4, extra_body=body
    )
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(
        model=model, prompt=PROMPT, n=2, max_tokens=4, stream=True, extra_body=body
    ):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {c.index: c.text for c in whole.choices}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 0}, "n"),
        ({"top_p": 0.5}, "top_p"),
        ({"logprobs": 2}, "logprobs"),
        ({"stop": ["x"]}, "stop"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs"),
        ({"length_penalty": "long"}, "length_penalty"),
        ({"n": 2, "best_of": 1}, "best_of"),
    ],
)
def test_bad_beam_requests_are_a_400_naming_the_field(server_url, model, fields, param):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 3, "use_beam_search": True}
    response = httpx.post(
        f"{server_url}/v1/completions",
        json={**body, **fields},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param or param in error["message"], error


def test_beam_fields_without_beam_search_are_refused(client, model):
    for field, value in (("length_penalty", 0.5), ("early_stopping", True)):
        with pytest.raises(openai.BadRequestError, match=f"{field} applies only with"):
            client.completions.create(
                model=model, prompt=PROMPT, max_tokens=2, extra_body={field: value}
            )
