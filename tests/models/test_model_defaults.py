"""What the checkpoint and the config set for every request: generation_config.json's
sampling defaults (as vLLM applies them) and a configured chat template."""

from __future__ import annotations

import json
import shutil

import pytest

from enginecore import LLM, SamplingParams
from enginecore.errors import ConfigError

TEMPLATE = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"


@pytest.fixture(scope="module")
def recommending_checkpoint(tiny_llama, tmp_path_factory):
    """The tiny checkpoint with sampling values in its generation_config.json."""
    path = tmp_path_factory.mktemp("gen-config") / "ckpt"
    shutil.copytree(tiny_llama, path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen.update(temperature=0.0, max_new_tokens=3, top_k=5)
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


def test_generation_config_values_are_the_defaults(recommending_checkpoint, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    with LLM(
        recommending_checkpoint,
        multiprocessing=False,
        num_blocks_override=64,
        max_model_len=128,
        chat_template=str(template),
    ) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.max_tokens, defaults.top_k) == (0.0, 3, 5)
        (out,) = llm.generate(["Hello there"], use_tqdm=False)
        assert len(out.outputs[0].token_ids) <= 3
        greedy = SamplingParams(temperature=0.0, max_tokens=3)
        (same,) = llm.generate(["Hello there"], greedy, use_tqdm=False)
        assert out.outputs[0].token_ids == same.outputs[0].token_ids
        # The configured template renders the conversation.
        (chat,) = llm.chat([{"role": "user", "content": "hi"}], greedy, use_tqdm=False)
        assert chat.prompt_token_ids == llm.tokenizer.encode("<hi>")


def test_generation_config_vllm_ignores_the_file(recommending_checkpoint):
    from enginecore import make_config
    from enginecore.engine.model_defaults import sampling_defaults

    auto = make_config(model=str(recommending_checkpoint))
    assert sampling_defaults(auto) == {"temperature": 0.0, "top_k": 5, "max_tokens": 3}
    off = make_config(model=str(recommending_checkpoint), generation_config="vllm")
    assert sampling_defaults(off) == {}


def test_a_missing_chat_template_file_fails_before_the_engine_starts(tiny_llama):
    with pytest.raises(ConfigError, match="neither a file nor a template"):
        LLM(tiny_llama, multiprocessing=False, chat_template="/no/such/template.jinja")
