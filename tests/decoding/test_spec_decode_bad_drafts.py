"""A proposer's draft ids are checked against the model's vocabulary: an id past it (here
exactly ``vocab_size``, the first id with no embedding row) fails that request with an
error naming the proposer, its plugin and the config key, after the tokens the request
had; the other requests in the batch, and those added afterwards, are served as if
nothing had happened (equal to the engine without speculation). Sync and async
scheduling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from enginecore import SamplingParams, make_config
from enginecore.engine.core import EngineCore
from enginecore.interfaces import SpecDecodeProposer
from enginecore.plugins import make_plugin_manager
from enginecore.protocol import EngineCoreRequest
from enginecore.request import FinishReason
from tests.helpers.plugin_host import registering

MARKER = 7  # a prompt starting with this token gets drafts past the vocabulary
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = {"bad": [MARKER, 40, 41, 42], "good": [9, 50, 51, 52, 50, 51], "later": [11, 60, 61]}


class PastVocabProposer(SpecDecodeProposer):
    """Proposes ``vocab_size`` for marked prompts, the last token again for the rest."""

    def __init__(self, config) -> None:
        super().__init__(config)
        hf = json.loads((Path(config.model.path) / "config.json").read_text())
        self.vocab_size = int(hf["vocab_size"])

    def propose(self, token_ids, max_num_drafts):
        if int(token_ids[0]) == MARKER:
            return [self.vocab_size] * max_num_drafts
        return [int(token_ids[-1])] * max_num_drafts


def run(path, requests: list[str], **overrides) -> dict[str, tuple[list[int], str | None, str]]:
    """Each request's tokens, error and finish reason; ``later`` is added once the
    others have finished."""
    host = make_plugin_manager()
    host.register_object(
        registering("register_spec_decode_proposers", "past_vocab", PastVocabProposer),
        "past_vocab_plugin",
    )
    config = make_config(
        model=str(path),
        dtype="float32",
        multiprocessing=False,
        num_blocks_override=128,
        **overrides,
    )
    engine = EngineCore(config, host)
    got: dict[str, tuple[list[int], str | None, str]] = {}

    def add(request_id: str) -> None:
        got[request_id] = ([], None, "")
        engine.add_request(
            EngineCoreRequest(
                request_id=request_id,
                prompt_token_ids=PROMPTS[request_id],
                sampling_params=GREEDY,
                arrival_time=0.0,
            )
        )

    try:
        for request_id in requests:
            if request_id != "later":
                add(request_id)
        step = engine.step_fn()
        for phase in range(2):
            while engine.has_work():
                outputs, _ = step()
                for client_outputs in outputs.values():
                    for out in client_outputs.outputs:
                        tokens, error, reason = got[out.request_id]
                        tokens.extend(out.new_token_ids)
                        if out.finish_reason is not None:
                            reason = str(out.finish_reason)
                        got[out.request_id] = (tokens, out.error or error, reason)
            if phase == 0 and "later" in requests:
                add("later")
    finally:
        engine.shutdown()
    return got


@pytest.fixture(scope="module")
def baseline(tiny_llama):
    return run(tiny_llama, list(PROMPTS))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_drafts_past_the_vocabulary_fail_only_their_request(tiny_llama, baseline, async_scheduling):
    got = run(
        tiny_llama,
        list(PROMPTS),
        speculative_method="past_vocab",
        num_speculative_tokens=3,
        async_scheduling=async_scheduling,
    )
    tokens, error, reason = got["bad"]
    assert reason == str(FinishReason.ERROR), got["bad"]
    assert error is not None
    assert "PastVocabProposer.propose returned" in error, error
    assert "past the vocabulary (token ids are 0..8191)" in error, error
    assert "(config key speculative.speculative_method)" in error, error
    # The tokens it had are the model's own (the first one, sampled before any draft).
    assert tokens and tokens == baseline["bad"][0][: len(tokens)]
    for request_id in ("good", "later"):
        assert got[request_id][1] is None, got[request_id]
        assert got[request_id][0] == baseline[request_id][0]
