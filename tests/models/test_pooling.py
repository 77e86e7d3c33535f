"""The pooling runner against sentence-transformers on random-weight checkpoints made
offline: last-token pooling on a Qwen3 decoder saved head-less (as sentence-transformers
saves it), mean pooling on a Llama saved with its LM head and prefilled in chunks, mean
and CLS pooling on a BERT encoder; ``LLM.embed`` / ``encode`` / ``score``, and the clear
errors for the wrong kind of request."""

from __future__ import annotations

import math

import numpy as np
import pytest

from enginecore import LLM, InvalidRequestError, PoolingParams, SamplingParams
from enginecore.embedding_checkpoints import make_embedding_checkpoint

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "import json\nprint(json.dumps({'a': 1}))",
    "x",
    "def main():\n    return asyncio.run(serve(host='127.0.0.1', port=8000)) # " * 3,
]


def _reference(path, texts):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")
    return model.encode(texts, convert_to_numpy=True, batch_size=2)


def _engine(path, **kw):
    # In this process: the values are the runner's and the model's (the pooling runner
    # behind an engine process and a server is tests/server/test_server_pooling.py's).
    return LLM(
        path, runner="pooling", max_num_seqs=8, kv_cache_bytes=8 << 20, multiprocessing=False, **kw
    )


@pytest.fixture(scope="module")
def qwen3_embedder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-embed")
    return make_embedding_checkpoint(
        path, "qwen3", "last", config_overrides={"is_matryoshka": True}
    )


@pytest.fixture(scope="module")
def qwen3_llm(qwen3_embedder):
    llm = _engine(qwen3_embedder)
    yield llm
    llm.shutdown()


def test_qwen3_last_token_equals_sentence_transformers(qwen3_llm, qwen3_embedder):
    outputs = qwen3_llm.embed(TEXTS, use_tqdm=False)
    got = np.array([o.outputs.embedding for o in outputs])
    np.testing.assert_allclose(got, _reference(qwen3_embedder, TEXTS), atol=2e-5, rtol=1e-4)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert [o.prompt_token_ids for o in outputs] == [qwen3_llm.tokenizer.encode(t) for t in TEXTS]


def test_dimensions_truncate_then_normalize_and_normalize_off(qwen3_llm):
    full = qwen3_llm.encode(TEXTS[:1], PoolingParams(normalize=False), use_tqdm=False)
    raw = np.array(full[0].outputs.data)
    short = qwen3_llm.embed(TEXTS[:1], PoolingParams(dimensions=16), use_tqdm=False)
    vec = np.array(short[0].outputs.embedding)
    assert vec.shape == (16,)
    np.testing.assert_allclose(vec, raw[:16] / np.linalg.norm(raw[:16]), atol=1e-5)
    assert not math.isclose(float(np.linalg.norm(raw)), 1.0, abs_tol=1e-3)


def test_score_is_cosine_similarity(qwen3_llm, qwen3_embedder):
    ref = _reference(qwen3_embedder, TEXTS)
    scores = qwen3_llm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)
    want = [float(ref[0] @ ref[i]) for i in range(1, len(TEXTS))]
    np.testing.assert_allclose([s.outputs.score for s in scores], want, atol=1e-5)
    with pytest.raises(InvalidRequestError, match="one text with N, or N with N"):
        qwen3_llm.score(TEXTS[:2], TEXTS[:3], use_tqdm=False)


def test_generation_on_a_pooling_model_is_refused(qwen3_llm):
    with pytest.raises(InvalidRequestError, match="serves embeddings"):
        qwen3_llm.generate(TEXTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    # The engine is unharmed: the next pooling request is served.
    assert len(qwen3_llm.embed(TEXTS[:1], use_tqdm=False)[0].outputs.embedding) == 128


def test_embed_on_a_generation_model_is_refused(tiny_llama):
    # The frontend refuses it before any request reaches an engine: the engine in this
    # process is enough.
    llm = LLM(tiny_llama, max_num_seqs=2, kv_cache_bytes=4 << 20, multiprocessing=False)
    try:
        with pytest.raises(InvalidRequestError, match="--runner pooling"):
            llm.embed(TEXTS[:1], use_tqdm=False)
    finally:
        llm.shutdown()


def test_llama_mean_pooling_in_chunks(tmp_path):
    """A causal-LM checkpoint (with its LM head, ``model.`` names) pooled by mean over a
    prompt prefilled in several chunks equals the whole-prompt reference."""
    path = make_embedding_checkpoint(tmp_path / "llama", "llama", "mean", causal_lm=True)
    llm = _engine(path, max_num_batched_tokens=16, chunked_prefill=True, block_size=8)
    try:
        assert max(len(llm.tokenizer.encode(t)) for t in TEXTS) > 40  # several chunks
        got = np.array([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    finally:
        llm.shutdown()
    np.testing.assert_allclose(got, _reference(path, TEXTS), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("pooling", "normalize"), [("mean", True), ("cls", False)])
def test_bert_encoder_equals_sentence_transformers(tmp_path, pooling, normalize):
    path = make_embedding_checkpoint(tmp_path / "bert", "bert", pooling, normalize)
    llm = _engine(path, task="embed")
    try:
        assert llm.config.model.runner == "pooling"
        got = np.array([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    finally:
        llm.shutdown()
    np.testing.assert_allclose(got, _reference(path, TEXTS), atol=2e-5, rtol=1e-4)
