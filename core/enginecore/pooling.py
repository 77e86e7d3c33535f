"""Pooling models (embeddings): the per-request :class:`PoolingParams` and the
checkpoint's pooling set-up, as sentence-transformers ships it.

A sentence-transformers checkpoint lists its modules in ``modules.json``: the
transformer, a ``Pooling`` module whose ``config.json`` (``1_Pooling/config.json``) names
the pooling mode, and optionally ``Normalize``. A checkpoint without them (a bare
decoder such as Qwen3-Embedding's ``config.json``) pools its last token and normalizes,
as vLLM does; a bare BERT-family encoder pools its CLS token.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Literal

import msgspec

from enginecore.errors import ConfigError, InvalidRequestError

PoolingType = Literal["last", "mean", "cls"]

# 1_Pooling/config.json flag -> pooling type.
_ST_MODES: dict[str, PoolingType] = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
# sentence-transformers' ``pooling_mode`` names -> the flag suffix older releases write.
_ST_NAMES = {"lasttoken": "lasttoken", "mean": "mean_tokens", "cls": "cls_token"}
# Encoder-only architectures: bidirectional attention, CLS pooling by default.
ENCODER_MODEL_TYPES = frozenset({"bert"})


class PoolingParams(msgspec.Struct, omit_defaults=True, kw_only=True, array_like=True):
    """How to pool one request. Field order is wire ABI: append new fields.

    ``normalize`` None keeps the checkpoint's choice; ``dimensions`` truncates the vector
    (Matryoshka models only) before it is normalized.
    """

    task: Literal["embed", "encode"] = "embed"
    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and self.dimensions < 1:
            raise InvalidRequestError(f"dimensions must be >= 1, got {self.dimensions}")


class PoolerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The checkpoint's pooling: type, normalization, and the Matryoshka sizes it allows."""

    pooling_type: PoolingType
    normalize: bool
    hidden_size: int
    # None: any size up to hidden_size is allowed only when is_matryoshka is set.
    matryoshka_dimensions: list[int] | None = None
    is_matryoshka: bool = False

    def check_dimensions(self, dimensions: int | None) -> None:
        """A clear error for ``dimensions`` this model cannot give (vLLM's rule)."""
        if dimensions is None:
            return
        if not self.is_matryoshka:
            raise InvalidRequestError(
                "this model does not support Matryoshka representations: 'dimensions' "
                "cannot be set (a checkpoint opts in with is_matryoshka or "
                "matryoshka_dimensions in config.json)"
            )
        allowed = self.matryoshka_dimensions
        if allowed is not None and dimensions not in allowed:
            raise InvalidRequestError(
                f"dimensions must be one of {allowed} for this model, got {dimensions}"
            )
        if not 1 <= dimensions <= self.hidden_size:
            raise InvalidRequestError(
                f"dimensions must be between 1 and the model's {self.hidden_size}, got {dimensions}"
            )


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    return [str(value)] if isinstance(value, str) else [str(v) for v in value]


def _st_module_dirs(root: pathlib.Path) -> tuple[pathlib.Path | None, bool | None]:
    """The Pooling module's folder and whether a Normalize module follows (None: no
    modules.json)."""
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return None, None
    modules = json.loads(modules_file.read_text())
    pooling_dir = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith("Pooling"):
            pooling_dir = root / str(module.get("path", ""))
        elif kind.endswith("Normalize"):
            normalize = True
    return pooling_dir, normalize


def read_pooler_config(path: str, hf_config: Any) -> PoolerConfig:
    """The pooling the checkpoint at ``path`` asks for (see the module docstring)."""
    root = pathlib.Path(path)
    root = root if root.is_dir() else root.parent
    encoder = getattr(hf_config, "model_type", "") in ENCODER_MODEL_TYPES
    pooling_type: PoolingType = "cls" if encoder else "last"
    normalize = True
    pooling_dir, st_normalize = _st_module_dirs(root)
    if st_normalize is not None:
        normalize = st_normalize
    if pooling_dir is not None and (pooling_dir / "config.json").is_file():
        settings = json.loads((pooling_dir / "config.json").read_text())
        # Older releases set one flag per mode, newer ones name the mode(s).
        named = settings.get("pooling_mode")
        flags = {f"pooling_mode_{_ST_NAMES.get(m, m)}": True for m in _as_list(named)}
        flags.update({k: v for k, v in settings.items() if k.startswith("pooling_mode_")})
        chosen = [mode for flag, mode in _ST_MODES.items() if flags.get(flag)]
        others = [k for k, v in flags.items() if v and k not in _ST_MODES]
        if others or len(chosen) != 1:
            raise ConfigError(
                f"{pooling_dir / 'config.json'}: pooling modes {others or chosen} are not "
                "served; one of lasttoken, mean_tokens or cls_token must be set"
            )
        pooling_type = chosen[0]
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    return PoolerConfig(
        pooling_type=pooling_type,
        normalize=normalize,
        hidden_size=int(hf_config.hidden_size),
        matryoshka_dimensions=list(dims) if dims else None,
        is_matryoshka=bool(getattr(hf_config, "is_matryoshka", False) or dims),
    )


def checkpoint_pooler_config(path: str) -> PoolerConfig:
    """:func:`read_pooler_config` from the checkpoint's ``config.json`` alone (what the
    frontend needs to check ``dimensions`` without loading the model)."""
    import types

    root = pathlib.Path(path)
    root = root if root.is_dir() else root.parent
    fields = json.loads((root / "config.json").read_text())
    return read_pooler_config(str(root), types.SimpleNamespace(**fields))
