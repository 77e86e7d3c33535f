"""``LLM.embed``, ``LLM.encode`` and ``LLM.score``: what a pooling model serves offline,
shaped like vLLM's (``output.outputs.embedding``, ``.data``, ``.score``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec

from enginecore.errors import InvalidRequestError
from enginecore.params import SamplingParams
from enginecore.pooling import PoolingParams

T = TypeVar("T")


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class PoolingOutput:
    data: list[float]


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput(Generic[T]):
    request_id: str
    prompt_token_ids: list[int]
    outputs: T
    finished: bool = True


def cosine_similarity(a: Sequence[float], b: Sequence[float]) -> float:
    """The score of a pair under an embedding model (vLLM's, for bi-encoders)."""
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


def score_pairs(first: Any, second: Any) -> list[tuple[Any, Any]]:
    """vLLM's pairing: one text against each of several (1:N), or N:N in order."""
    left = [first] if isinstance(first, str | dict) else list(first)
    right = [second] if isinstance(second, str | dict) else list(second)
    if not left or not right:
        raise InvalidRequestError("score needs at least one text on each side")
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise InvalidRequestError(
            f"score pairs one text with N, or N with N in order; got {len(left)} and {len(right)}"
        )
    return list(zip(left, right, strict=True))


class PoolingMethods:
    """Mixed into :class:`~enginecore.LLM`; needs its ``generate``."""

    def generate(self, *args: Any, **kwargs: Any) -> Any: ...  # supplied by LLM

    def _pool(
        self, prompts: Any, pooling_params: PoolingParams | None, task: str, use_tqdm: bool
    ) -> list[Any]:
        params = msgspec.structs.replace(pooling_params or PoolingParams(), task=task)
        return list(
            self.generate(prompts, SamplingParams(max_tokens=1, pooling=params), use_tqdm=use_tqdm)
        )

    def embed(
        self,
        prompts: Any,
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput[EmbeddingOutput]]:
        """One embedding per prompt (a str, token ids or ``{"prompt_token_ids": ...}``),
        in input order; needs an engine with ``runner="pooling"`` (or ``task="embed"``)."""
        return [
            PoolingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(o.pooled))
            for o in self._pool(prompts, pooling_params, "embed", use_tqdm)
        ]

    def encode(
        self,
        prompts: Any,
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput[PoolingOutput]]:
        """The model's pooled output per prompt (``outputs.data``), as vLLM's ``encode``."""
        return [
            PoolingRequestOutput(o.request_id, o.prompt_token_ids, PoolingOutput(o.pooled))
            for o in self._pool(prompts, pooling_params, "encode", use_tqdm)
        ]

    def score(
        self,
        data_1: Any,
        data_2: Any,
        *,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput[ScoringOutput]]:
        """Cosine similarity of each pair's embeddings (``outputs.score``): ``data_1``
        one text against each of ``data_2``, or N against N in order."""
        pairs = score_pairs(data_1, data_2)
        texts = [p for pair in pairs for p in pair]
        embedded = self.embed(texts, use_tqdm=use_tqdm)
        results = []
        for i in range(len(pairs)):
            a, b = embedded[2 * i], embedded[2 * i + 1]
            results.append(
                PoolingRequestOutput(
                    f"score-{a.request_id}-{b.request_id}",
                    a.prompt_token_ids + b.prompt_token_ids,
                    ScoringOutput(cosine_similarity(a.outputs.embedding, b.outputs.embedding)),
                )
            )
        return results
