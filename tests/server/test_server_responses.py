"""``/v1/responses`` (OpenAI's Responses API, text) through a real ``enginecore serve`` and
the real ``openai`` client's ``client.responses``: each answer equals the chat completion
of the same conversation (greedy), streamed and not."""

from __future__ import annotations

import httpx
import openai
import pytest

from enginecore.server.responses import ResponseStore

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def server_url(plain_server_url):
    return plain_server_url


@pytest.fixture(scope="module")
def client(server_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def chat_text(client, model, messages, max_tokens=MAX_TOKENS) -> tuple[str, object]:
    out = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0.0
    )
    return out.choices[0].message.content, out


def test_text_input_answers_like_chat(client, model):
    response = client.responses.create(
        model=model, input="Say something.", max_output_tokens=MAX_TOKENS, temperature=0.0
    )
    expected, chat = chat_text(client, model, [{"role": "user", "content": "Say something."}])
    assert response.object == "response"
    assert response.id.startswith("resp_")
    assert response.output_text == expected
    assert response.output[0].type == "message"
    assert response.output[0].role == "assistant"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    if chat.choices[0].finish_reason == "length":
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed"


def test_message_items_and_instructions(client, model):
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "message", "role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Again?"},
    ]
    response = client.responses.create(
        model=model,
        input=items,
        instructions="Be brief.",
        max_output_tokens=MAX_TOKENS,
        temperature=0.0,
        top_p=1.0,
    )
    expected, _ = chat_text(
        client,
        model,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Again?"},
        ],
    )
    assert response.output_text == expected
    assert response.instructions == "Be brief."


def test_streaming_sends_the_event_sequence(client, model):
    whole = client.responses.create(
        model=model, input="Say something.", max_output_tokens=MAX_TOKENS, temperature=0.0
    )
    events = list(
        client.responses.create(
            model=model,
            input="Say something.",
            max_output_tokens=MAX_TOKENS,
            temperature=0.0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert deltas == done.text == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    completed = events[-1].response
    assert completed.output_text == whole.output_text
    assert completed.usage.output_tokens == whole.usage.output_tokens


def test_previous_response_id_continues_the_conversation(client, model):
    first = client.responses.create(
        model=model, input="Hi", max_output_tokens=MAX_TOKENS, temperature=0.0
    )
    second = client.responses.create(
        model=model,
        input="And then?",
        previous_response_id=first.id,
        max_output_tokens=MAX_TOKENS,
        temperature=0.0,
    )
    expected, _ = chat_text(
        client,
        model,
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"},
        ],
    )
    assert second.output_text == expected
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text


def test_unstored_responses_cannot_be_continued(client, model):
    unstored = client.responses.create(
        model=model, input="Hi", max_output_tokens=2, store=False, temperature=0.0
    )
    with pytest.raises(openai.NotFoundError, match="no stored response"):
        client.responses.create(
            model=model, input="More", previous_response_id=unstored.id, max_output_tokens=2
        )
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"text": {"format": {"type": "json_object"}}}, "text"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
        ),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input"),
        ({"max_output_tokens": 100000}, "max_output_tokens"),
        ({"no_such_field": 1}, "no_such_field"),
    ],
)
def test_unsupported_parts_are_a_400_naming_them(server_url, model, fields, param):
    body = {"model": model, "input": "Hi", **fields}
    response = httpx.post(f"{server_url}/v1/responses", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert param in error["message"] or param == "input", error


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="Hi")


def test_the_store_is_bounded():
    store = ResponseStore(capacity=2)
    for i in range(3):
        store.put({"id": f"r{i}"}, [])
    store.get("r1")  # r1 is now the most recently used: r2 goes next
    store.put({"id": "r3"}, [])
    with pytest.raises(Exception, match="no stored response"):
        store.get("r0")
    with pytest.raises(Exception, match="no stored response"):
        store.get("r2")
    assert store.get("r1")[0]["id"] == "r1" and store.get("r3")[0]["id"] == "r3"
