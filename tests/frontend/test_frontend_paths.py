"""``LLM`` and ``AsyncLLM`` (so the server) render chats on one path: ``LLM.chat`` takes
``continue_final_message`` and reports a template that fails as the request's error, as the
server's chat route always did."""

from __future__ import annotations

import pytest

from enginecore import LLM, SamplingParams
from enginecore.errors import InvalidRequestError

TEMPLATE = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
RAISING = "{{ raise_exception('this template takes no system messages') }}"
GREEDY = SamplingParams(temperature=0.0, max_tokens=2)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with LLM(
        tiny_llama,
        multiprocessing=False,
        num_blocks_override=64,
        max_model_len=128,
        chat_template=TEMPLATE,
    ) as llm:
        yield llm


def test_chat_continues_the_final_message(llm):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    (out,) = llm.chat(
        messages, GREEDY, add_generation_prompt=False, continue_final_message=True, use_tqdm=False
    )
    expected = llm.tokenizer.apply_chat_template(
        messages, chat_template=TEMPLATE, continue_final_message=True, tokenize=True
    )
    if not isinstance(expected, list):  # transformers 5 returns a BatchEncoding
        expected = list(expected["input_ids"])
    assert out.prompt_token_ids == expected
    assert llm.tokenizer.decode(expected).endswith("<Hel")  # left open, no closing ">"


def test_a_failing_template_is_the_requests_error(llm):
    with pytest.raises(InvalidRequestError, match="could not apply the chat template: this"):
        llm.chat([{"role": "system", "content": "x"}], GREEDY, chat_template=RAISING)
    (out,) = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2  # the engine serves on
