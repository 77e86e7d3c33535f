"""The pooling routes end to end: a real ``enginecore serve --runner pooling`` subprocess
on a random-weight Qwen3 embedder (Matryoshka), driven by the real ``openai`` client and
httpx; vectors compared with sentence-transformers'."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

from enginecore.embedding_checkpoints import make_embedding_checkpoint
from enginecore.errors import InvalidRequestError
from enginecore.pooling import checkpoint_pooler_config
from tests.helpers.serve_process import serve, stop

TEXTS = ["The quick brown fox.", "import json\nprint(json.dumps({'a': 1}))", "x"]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-embed")
    return make_embedding_checkpoint(
        path, "qwen3", "last", config_overrides={"is_matryoshka": True}
    )


@pytest.fixture(scope="module")
def reference(embedder):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(embedder), device="cpu").encode(TEXTS)


@pytest.fixture(scope="module")
def server(embedder, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    proc, url = serve(
        embedder,
        log,
        "--runner",
        "pooling",
        "--served-model-name",
        "emb",
        "--max-num-seqs",
        "8",
        "--kv-cache-bytes",
        str(8 << 20),
    )
    yield url
    stop(proc)


def test_openai_client_embeddings_equal_sentence_transformers(server, reference):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    # The openai client asks for base64 and decodes it: both encodings are exercised.
    result = client.embeddings.create(model="emb", input=TEXTS)
    got = np.array([d.embedding for d in result.data])
    np.testing.assert_allclose(got, reference, atol=2e-5, rtol=1e-4)
    assert [d.index for d in result.data] == [0, 1, 2]
    assert result.usage.prompt_tokens == result.usage.total_tokens > 0
    floats = client.embeddings.create(model="emb", input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, reference[0], atol=2e-5, rtol=1e-4)


def test_token_id_inputs_dimensions_and_base64(server, reference):
    ids = httpx.post(f"{server}/tokenize", json={"prompt": TEXTS[0]}).json()["tokens"]
    body = {"input": [ids, ids[:3]], "dimensions": 16, "encoding_format": "base64"}
    data = httpx.post(f"{server}/v1/embeddings", json=body, timeout=60).json()["data"]
    vec = np.frombuffer(base64.b64decode(data[0]["embedding"]), dtype="<f4")
    want = reference[0][:16] / np.linalg.norm(reference[0][:16])
    np.testing.assert_allclose(vec, want, atol=2e-5)
    too_big = httpx.post(f"{server}/v1/embeddings", json={"input": "a", "dimensions": 4096})
    assert too_big.status_code == 400 and "between 1 and" in too_big.json()["error"]["message"]


def test_pooling_score_and_rerank(server, reference):
    pooled = httpx.post(f"{server}/pooling", json={"input": TEXTS[1]}, timeout=60).json()
    assert pooled["data"][0]["object"] == "pooling"
    np.testing.assert_allclose(pooled["data"][0]["data"], reference[1], atol=2e-5, rtol=1e-4)
    want = [float(reference[0] @ reference[i]) for i in (1, 2)]
    for path in ("/score", "/v1/score"):
        body = {"text_1": TEXTS[0], "text_2": TEXTS[1:]}
        scores = httpx.post(f"{server}{path}", json=body, timeout=60).json()["data"]
        np.testing.assert_allclose([s["score"] for s in scores], want, atol=1e-5)
    body = {"query": TEXTS[0], "documents": TEXTS[1:], "top_n": 1}
    for path in ("/rerank", "/v1/rerank"):
        results = httpx.post(f"{server}{path}", json=body, timeout=60).json()["results"]
        best = int(np.argmax(want))
        assert len(results) == 1 and results[0]["index"] == best
        assert results[0]["document"]["text"] == TEXTS[1 + best]
        assert results[0]["relevance_score"] == pytest.approx(want[best], abs=1e-5)
    bad = httpx.post(f"{server}/score", json={"text_1": TEXTS[:2], "text_2": TEXTS})
    assert bad.status_code == 400


def test_generation_on_the_pooling_server_is_a_400(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="serves embeddings"):
        client.completions.create(model="emb", prompt="hello", max_tokens=2)
    # The server still serves embeddings afterwards.
    assert len(client.embeddings.create(model="emb", input="a").data[0].embedding) == 128


def test_dimensions_on_a_model_without_matryoshka_is_refused(tmp_path):
    path = make_embedding_checkpoint(tmp_path / "bert", "bert", "cls")
    config = checkpoint_pooler_config(str(path))
    assert (config.pooling_type, config.normalize, config.is_matryoshka) == ("cls", True, False)
    with pytest.raises(InvalidRequestError, match="does not support Matryoshka"):
        config.check_dimensions(16)
    config.check_dimensions(None)
