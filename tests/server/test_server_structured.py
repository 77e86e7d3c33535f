"""Structured output over HTTP: a real ``enginecore serve`` driven by the real ``openai`` client.

``response_format`` (``json_schema``, ``json_object``, ``structural_tag``) on chat and
completions, and the ``guided_*`` extras. A bad constraint is a 400 with the compiler's message while other
requests keep running.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from enginecore import StructuredOutputParams
from tests.helpers.serve_process import Server
from tests.helpers.structured import (
    CHOICES,
    CODE_REGEX,
    FORCED_FORM,
    PERSON_SCHEMA,
    VLLM_FORM,
    assert_tags_valid,
    check,
)

PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}


@pytest.fixture(scope="module")
def server(compat_server):
    """The folder's server with ``--disable-any-whitespace`` (random weights would loop on
    spaces); every request here names its ``max_tokens``."""
    srv = Server(compat_server.url(), compat_server.proc, None, compat_server.log_path)
    yield srv
    srv.http.close()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def chat(client, model, max_tokens=64, **kw):
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe a person."}],
        max_tokens=max_tokens,
        **kw,
    )


def test_chat_response_format_json_schema(client, model):
    for temperature in (0.0, 1.0):
        out = chat(client, model, response_format=PERSON_FORMAT, temperature=temperature, seed=3)
        assert out.choices[0].finish_reason == "stop"
        check(StructuredOutputParams(json=PERSON_SCHEMA), out.choices[0].message.content)


def test_completions_response_format_and_guided_extras(client, model):
    cases = [
        ({"response_format": PERSON_FORMAT}, StructuredOutputParams(json=PERSON_SCHEMA)),
        ({"guided_json": PERSON_SCHEMA}, StructuredOutputParams(json=PERSON_SCHEMA)),
        ({"guided_regex": CODE_REGEX}, StructuredOutputParams(regex=CODE_REGEX)),
        ({"guided_choice": CHOICES}, StructuredOutputParams(choice=CHOICES)),
        ({"guided_grammar": 'root ::= "x" [0-9] [0-9]?'}, StructuredOutputParams(regex=r"x\d\d?")),
    ]
    for extra, spec in cases:
        out = client.completions.create(
            model=model, prompt="Answer:", max_tokens=64, temperature=0.0, extra_body=extra
        )
        assert out.choices[0].finish_reason == "stop", (extra, out.choices[0].text)
        check(spec, out.choices[0].text)


def test_chat_guided_choice_streams(client, model):
    stream = chat(
        client, model, stream=True, temperature=0.7, seed=1, extra_body={"guided_choice": CHOICES}
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text in CHOICES


def test_json_object(client, model):
    out = chat(
        client, model, response_format={"type": "json_object"}, max_tokens=200, temperature=0.0
    )
    choice = out.choices[0]
    if choice.finish_reason == "stop":  # a random model may still be inside a string at the cap
        assert isinstance(json.loads(choice.message.content), dict)
    assert choice.message.content.startswith("{")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"guided_json": {"type": "objectx"}}, 'invalid JSON schema: Unsupported type "objectx"'),
        ({"guided_regex": "a(b"}, "invalid regex: Regex parsing error at position 4"),
        ({"guided_grammar": "root ::= foo"}, 'invalid grammar: .*Rule "foo" is not defined'),
        ({"guided_choice": []}, "choice needs a non-empty list"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "one structured-output constraint"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "needs json_schema.schema",
        ),
    ],
)
def test_bad_constraint_is_a_400_and_others_keep_running(client, model, extra, message):
    def good(i):
        return client.completions.create(
            model=model,
            prompt=f"{i}:",
            max_tokens=12,
            temperature=0.0,
            extra_body={"guided_choice": CHOICES},
        )

    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(good, i) for i in range(3)]
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=8,
                extra_body=extra,
            )
        assert info.value.status_code == 400
        assert re.search(message, info.value.message), info.value.message
        for future in running:
            assert future.result().choices[0].text in CHOICES


def test_structural_tag(client, model):
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Call a tool."}],
        max_tokens=80,
        response_format=FORCED_FORM,
    )
    assert_tags_valid(out.choices[0].message.content)
    out = client.completions.create(
        model=model,
        prompt="Call a tool.",
        max_tokens=80,
        extra_body={"structured_outputs": {"structural_tag": json.dumps(FORCED_FORM)}},
    )
    assert_tags_valid(out.choices[0].text)
    # vLLM's structures/triggers form is accepted as response_format too: free text, and
    # any tag the model opens follows its schema.
    out = client.completions.create(
        model=model,
        prompt="Call a tool.",
        max_tokens=40,
        extra_body={"response_format": {"type": "structural_tag", **VLLM_FORM}},
    )
    assert_tags_valid(out.choices[0].text, at_least=0)
    with pytest.raises(openai.BadRequestError, match="starts with none of the triggers"):
        client.completions.create(
            model=model,
            prompt="Call a tool.",
            extra_body={
                "response_format": {
                    "type": "structural_tag",
                    "structures": [{"begin": "<x>", "schema": {}, "end": "</x>"}],
                    "triggers": ["<t"],
                }
            },
        )
