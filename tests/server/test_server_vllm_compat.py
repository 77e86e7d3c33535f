"""What a vLLM user sends works the same, and nothing is silently ignored: a real
``enginecore serve`` on a tiny random Llama, driven by the real ``openai`` client (httpx
where the client hides the wire).
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.helpers.serve_process import Server
from tests.helpers.shared_server import COMPAT_MAX_MODEL_LEN, COMPAT_MAX_NEW_TOKENS

MAX_MODEL_LEN = COMPAT_MAX_MODEL_LEN
PROMPT = "The quick brown fox jumps over the lazy dog"
USER = [{"role": "user", "content": "Say something."}]


#: The checkpoint's generation_config.json recommends this many new tokens.
MAX_NEW_TOKENS = COMPAT_MAX_NEW_TOKENS


@pytest.fixture(scope="module")
def server(compat_server):
    srv = Server(compat_server.url(), compat_server.proc, None, compat_server.log_path)
    yield srv
    srv.http.close()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def tokenize(server, **body) -> list[int]:
    response = server.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


# --- 1. tool_choice "required" with $defs / $ref -------------------------------------------


def test_required_tool_choice_accepts_defs_and_refs(client, model):
    # The shape pydantic's model_json_schema() gives a model with a nested model.
    address = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    }
    ship = {
        "type": "function",
        "function": {
            "name": "ship",
            "parameters": {
                "$defs": {"Address": address},
                "type": "object",
                "properties": {"to": {"$ref": "#/$defs/Address"}},
                "required": ["to"],
            },
        },
    }
    track = {
        "type": "function",
        "function": {
            "name": "track",
            "parameters": {
                "$defs": {"Address": address},  # the same definition: merged
                "type": "object",
                "properties": {"at": {"$ref": "#/$defs/Address"}},
            },
        },
    }
    out = client.chat.completions.create(
        model=model,
        messages=USER,
        tools=[ship, track],
        tool_choice="required",
        max_tokens=24,
        temperature=0,
    )
    assert out.choices[0].finish_reason in ("tool_calls", "length")
    clash = json.loads(json.dumps(track))
    clash["function"]["parameters"]["$defs"]["Address"] = {"type": "string"}
    with pytest.raises(openai.BadRequestError, match="'Address' is defined differently"):
        client.chat.completions.create(
            model=model, messages=USER, tools=[ship, clash], tool_choice="required"
        )


# --- 2. an unknown model is a 404 ------------------------------------------------------------


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="no-such-model", messages=USER, max_tokens=1)


# --- 3. continue_final_message ---------------------------------------------------------------


def test_continue_final_message_leaves_the_last_turn_open(server, client, model, tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    partial = [*USER, {"role": "assistant", "content": "Well, the answer is"}]
    open_turn = tokenize(
        server, messages=partial, continue_final_message=True, add_generation_prompt=False
    )
    closed_turn = tokenize(server, messages=partial, add_generation_prompt=False)
    expected = tok.apply_chat_template(
        partial, continue_final_message=True, add_generation_prompt=False, tokenize=True
    )
    if not isinstance(expected, list):  # transformers 5 returns a BatchEncoding
        expected = list(expected["input_ids"])
    assert open_turn == expected
    assert tok.decode(open_turn).endswith("Well, the answer is")
    assert not tok.decode(closed_turn).endswith("Well, the answer is")
    out = client.chat.completions.create(
        model=model,
        messages=partial,
        max_tokens=2,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert out.usage.prompt_tokens == len(open_turn)
    with pytest.raises(openai.BadRequestError, match="cannot both be true"):
        client.chat.completions.create(
            model=model, messages=partial, extra_body={"continue_final_message": True}
        )
    response = server.post("/tokenize", json={"messages": partial, "continue_final_message": True})
    assert response.status_code == 400 and "cannot both be true" in response.text


# --- 4. completions top_logprobs hold the sampled token ---------------------------------------


def test_completion_top_logprobs_include_the_sampled_token(client, model):
    out = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=40,
        temperature=1.5,
        seed=11,
        logprobs=1,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 40
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert token.startswith("token_id:")
        assert top[token] == pytest.approx(value)
        assert len(top) in (1, 2)
    # At this temperature, some sampled tokens are not the most likely one: then the dict
    # holds the top-1 and the sampled token, as OpenAI's does.
    assert any(len(top) == 2 for top in lp.top_logprobs)


# --- 5. streaming n > 1: one choice per chunk -----------------------------------------------


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streaming_several_choices_sends_one_choice_per_chunk(client, model, endpoint):
    common = dict(model=model, n=3, max_tokens=5, stream=True, temperature=1.0, seed=5)
    if endpoint == "completions":
        stream = client.completions.create(prompt=PROMPT, **common)
    else:
        stream = client.chat.completions.create(messages=USER, **common)
    seen = set()
    chunks = 0
    for chunk in stream:
        assert len(chunk.choices) == 1, chunk
        seen.add(chunk.choices[0].index)
        chunks += 1
    assert seen == {0, 1, 2} and chunks >= 6


# --- 6. stream_options, seed, max_tokens, best_of, suffix ------------------------------------


def test_stream_options_need_stream(client, model):
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        client.completions.create(
            model=model, prompt="hi", max_tokens=1, stream_options={"include_usage": True}
        )


def test_seed_accepts_the_int64_range(client, model):
    for seed in (-1, -(2**63), 2**63 - 1):
        out = client.completions.create(model=model, prompt="hi", max_tokens=2, seed=seed)
        assert out.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError, match="seed"):
        client.completions.create(model=model, prompt="hi", max_tokens=2, seed=2**63)


def test_max_tokens_beyond_the_context_is_a_400_naming_the_limit(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_MODEL_LEN)
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in str(info.value)
    with pytest.raises(openai.BadRequestError, match="'max_completion_tokens' is too large"):
        client.chat.completions.create(
            model=model, messages=USER, max_completion_tokens=MAX_MODEL_LEN
        )


def test_best_of_returns_the_candidate_with_the_highest_cumulative_logprob(client, model):
    common = dict(
        model=model,
        prompt=PROMPT,
        max_tokens=6,
        temperature=1.0,
        seed=21,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    all_three = client.completions.create(n=3, **common)
    best = client.completions.create(n=1, best_of=3, **common)
    assert len(best.choices) == 1
    assert best.usage.completion_tokens == 18  # every candidate was generated

    def total(choice) -> float:
        return sum(choice.logprobs.token_logprobs)

    expected = max(all_three.choices, key=total)
    assert best.choices[0].text == expected.text
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=model, prompt=PROMPT, n=2, best_of=1)
    with pytest.raises(openai.BadRequestError, match="best_of must equal n when streaming"):
        client.completions.create(model=model, prompt=PROMPT, best_of=2, stream=True)


def test_suffix_is_refused(client, model):
    with pytest.raises(openai.BadRequestError, match="suffix is not supported"):
        client.completions.create(model=model, prompt=PROMPT, suffix="end", max_tokens=2)


# --- 7. vLLM's request extensions, and unknown fields ----------------------------------------


def test_unknown_fields_are_a_400_naming_them(client, model, server):
    with pytest.raises(openai.BadRequestError, match="no_such_field: this server does not"):
        client.completions.create(
            model=model, prompt="hi", max_tokens=1, extra_body={"no_such_field": 1}
        )
    with pytest.raises(openai.BadRequestError, match=r"stream_options\.bogus"):
        client.chat.completions.create(
            model=model,
            messages=USER,
            stream=True,
            stream_options={"include_usage": True, "bogus": True},
        )
    response = server.post("/tokenize", json={"prompt": "hi", "add_bos": True})
    assert response.status_code == 400 and "add_bos" in response.text


def test_structured_outputs(client, model):
    choices = ["alpha", "beta"]
    out = client.chat.completions.create(
        model=model,
        messages=USER,
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert out.choices[0].message.content in choices
    out = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=10,
        extra_body={"structured_outputs": {"regex": "[xyz]{4}"}},
    )
    assert len(out.choices[0].text) == 4 and set(out.choices[0].text) <= set("xyz")
    with pytest.raises(openai.BadRequestError, match='structural_tag needs "structures"'):
        client.completions.create(
            model=model,
            prompt=PROMPT,
            extra_body={"structured_outputs": {"structural_tag": "{}"}},
        )
    with pytest.raises(openai.BadRequestError, match=r"structured_outputs\.whitespace_pattern"):
        client.completions.create(
            model=model,
            prompt=PROMPT,
            extra_body={"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
        )


def test_return_token_ids(server, client, model):
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, extra_body={"return_token_ids": True}
    )
    choice = out.choices[0].model_dump()
    assert choice["prompt_token_ids"] == tokenize(server, prompt=PROMPT)
    assert len(choice["token_ids"]) == out.usage.completion_tokens
    chat = client.chat.completions.create(
        model=model, messages=USER, max_tokens=4, extra_body={"return_token_ids": True}
    ).model_dump()
    assert chat["prompt_token_ids"] == tokenize(server, messages=USER)
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    streamed = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=4,
        stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    ids = [i for chunk in streamed for i in chunk.choices[0].model_dump()["token_ids"]]
    assert len(ids) == 4


def test_truncate_prompt_tokens_keeps_the_prompts_end(server, client, model):
    full = tokenize(server, prompt=PROMPT)
    out = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=1,
        echo=True,
        extra_body={"truncate_prompt_tokens": 3, "return_token_ids": True},
    )
    assert out.usage.prompt_tokens == 3
    assert out.choices[0].model_dump()["prompt_token_ids"] == full[-3:]
    chat = client.chat.completions.create(
        model=model, messages=USER, max_tokens=1, extra_body={"truncate_prompt_tokens": 5}
    )
    assert chat.usage.prompt_tokens == 5


def test_continuous_usage_stats(client, model):
    stream = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    )
    counts = [chunk.usage.completion_tokens for chunk in stream if chunk.choices]
    assert counts == sorted(counts) and counts[-1] == 5 and len(counts) >= 2


def test_chat_prompt_logprobs(server, client, model):
    out = client.chat.completions.create(
        model=model, messages=USER, max_tokens=1, extra_body={"prompt_logprobs": 1}
    ).model_dump()
    prompt = tokenize(server, messages=USER)
    assert len(out["prompt_logprobs"]) == len(prompt)
    assert out["prompt_logprobs"][0] is None
    assert str(prompt[1]) in out["prompt_logprobs"][1]


# --- 11. the checkpoint's generation_config.json -----------------------------------------


def test_generation_config_sampling_defaults_apply(client, model):
    out = client.chat.completions.create(
        model=model, messages=USER, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == MAX_NEW_TOKENS
    asked = client.chat.completions.create(
        model=model, messages=USER, max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert asked.usage.completion_tokens == 2


def test_tokenizer_info(server, tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    info = server.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == type(tok).__name__
    assert info["chat_template"] == tok.chat_template
    assert info["vocab_size"] == len(tok) and info["max_model_len"] == MAX_MODEL_LEN
