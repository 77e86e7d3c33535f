"""The engine-side grammar manager with the real xgrammar backend, without an engine:
draft-token rows and rollback (speculative decoding), rejection, the compile cache."""

from __future__ import annotations

import time

import numpy as np
import pytest

from enginecore import SamplingParams, StructuredOutputParams, make_config
from enginecore.plugins import make_plugin_manager
from enginecore.request import Request, RequestStatus
from enginecore.runner_output import ModelRunnerOutput
from enginecore.scheduler_output import SchedulerOutput
from enginecore.structured_output import StructuredOutputManager


@pytest.fixture(scope="module")
def manager(tiny_llama):
    config = make_config(model=str(tiny_llama))
    manager = StructuredOutputManager(config, make_plugin_manager(load_entrypoints=False))
    yield manager
    manager.shutdown()


@pytest.fixture(scope="module")
def tokenizer(manager):
    return manager._get_backend().tokenizer


def admit(manager, request_id: str, spec: StructuredOutputParams) -> Request:
    request = Request(request_id, [5, 6, 7], SamplingParams(structured_output=spec))
    manager.add_request(request)
    assert request.status == RequestStatus.WAITING_FOR_GRAMMAR
    deadline = time.monotonic() + 60
    while True:
        ready, failed = manager.take_ready()
        assert not failed, failed
        if ready:
            assert ready == [request] and request.status == RequestStatus.WAITING
            return request
        assert time.monotonic() < deadline
        time.sleep(0.01)


def allowed(bitmask: np.ndarray, row: int) -> set[int]:
    bits = np.unpackbits(bitmask[row].view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def step(manager, ids, drafts=None) -> np.ndarray:
    out = manager.grammar_output(
        SchedulerOutput(
            structured_output_request_ids=ids, scheduled_spec_decode_tokens=drafts or {}
        )
    )
    assert out.structured_output_request_ids == ids
    return out.grammar_bitmask


def test_bitmask_width_is_the_models_vocab(manager):
    admit(manager, "w", StructuredOutputParams(regex="[0-9]+"))
    assert step(manager, ["w"]).shape == (1, (8192 + 31) // 32)
    manager.abort(["w"], RequestStatus.FINISHED_ABORTED)


def test_draft_rows_then_rollback(manager, tokenizer):
    choice = "hello world again"
    tokens = tokenizer.encode(choice, add_special_tokens=False)
    assert len(tokens) >= 3
    admit(manager, "d", StructuredOutputParams(choice=[choice]))
    admit(manager, "ref", StructuredOutputParams(choice=[choice]))  # walked by hand
    drafts = [tokens[0], tokens[1], 3]  # the third draft breaks the grammar
    rows = step(manager, ["d"], {"d": drafts})
    assert rows.shape[0] == 1 + len(drafts)
    for i in range(3):  # row i: the mask after the drafts before it
        expected = step(manager, ["ref"])[0]
        assert np.array_equal(rows[i], expected), i
        assert tokens[i] in allowed(rows, i)
        assert manager.grammars["ref"].accept_tokens([tokens[i]])
    assert 3 not in allowed(rows, 2)
    assert (rows[3] == -1).all()  # after a rejected draft: left open, the draft is rejected
    # Drafts leave no trace: the grammar is back at its start.
    assert np.array_equal(step(manager, ["d"])[0], rows[0])
    manager.abort(["d", "ref"], RequestStatus.FINISHED_ABORTED)


def test_sampled_tokens_advance_and_a_rejected_token_is_reported(manager, tokenizer):
    tokens = tokenizer.encode("yes", add_special_tokens=False)
    admit(manager, "a", StructuredOutputParams(choice=["yes", "no"]))
    admit(manager, "b", StructuredOutputParams(choice=["yes", "no"]))
    runner = ModelRunnerOutput(
        req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1}, sampled_token_ids=[tokens, [3]]
    )
    so = SchedulerOutput(structured_output_request_ids=["a", "b"])
    advance = manager.accept_sampled(so, runner)
    rejected = advance.rejected
    assert [r for r, _ in rejected] == ["b"] and "rejected sampled tokens [3]" in rejected[0][1]
    assert "b" not in manager.grammars and advance.ended == {}
    mask = step(manager, ["a"])
    eos = manager._get_backend().eos_token_ids
    assert allowed(mask, 0) == set(eos)  # only EOS is left
    # EOS and tokens sampled past it in one step (ignore_eos, drafts): the grammar ends
    # after the first, and what follows is not fed to it.
    runner = ModelRunnerOutput(
        req_ids=["a"], req_id_to_index={"a": 0}, sampled_token_ids=[[eos[0], *tokens]]
    )
    advance = manager.accept_sampled(SchedulerOutput(structured_output_request_ids=["a"]), runner)
    assert advance.rejected == [] and advance.ended == {"a": 1}
    assert manager.grammars["a"].is_terminated()
    manager.abort(["a"], RequestStatus.FINISHED_ABORTED)


def test_same_constraint_compiles_once(manager):
    spec = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    reordered = dict(reversed(list(spec.items())))
    first = admit(manager, "c1", StructuredOutputParams(json=spec))
    second = admit(manager, "c2", StructuredOutputParams(json=reordered))
    futures = [f for key, f in manager._cache.items() if key[0] == "json"]
    assert len(futures) == 1
    manager.abort([first.request_id, second.request_id], RequestStatus.FINISHED_ABORTED)
    assert not manager.grammars
