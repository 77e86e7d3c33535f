"""Read checkpoints: HF directories (config.json + safetensors) and GGUF files.

Both produce the same thing for a model's ``load_weights``: an iterator of
``(hf_name, tensor)`` pairs with HF names and HF layouts. GGUF tensors are de-quantized
at load time, except projections in the block formats a linear method asks for
(``keep_quantized``), which arrive as :class:`QuantizedTensor`; llama.cpp's conventions
are undone either way (``gguf_archs.py``).
"""

from __future__ import annotations

import functools
import json
import logging
import pathlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from enginecore import startup_log
from enginecore.block_formats.gguf_reader import GGUFMetadata
from enginecore.errors import ConfigError, UnsupportedModelError
from enginecore.layers.quantized import INT4_BLOCKS, QuantizedTensor
from enginecore.layers.weights import MissingWeightsError, load_params
from enginecore.registry import import_ref
from enginecore_models.checkpoint_support import SUPPORTED_WEIGHTS
from enginecore_models.gguf_archs import dequantized, gguf_config, hf_tensors, unpermute_rope
from enginecore_models.group_quant import group_quant_config, iter_group_quantized

logger = logging.getLogger(__name__)


_FLOAT8 = {
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
    if hasattr(torch, name)
}


class UnknownArchitectureError(ConfigError):
    """No registered model class serves the checkpoint's architecture."""


# --- configs --------------------------------------------------------------------------


def is_gguf(path: str | pathlib.Path) -> bool:
    return str(path).endswith(".gguf") and pathlib.Path(path).is_file()


def load_hf_config(path: str | pathlib.Path) -> Any:
    """The transformers config of a checkpoint directory or a GGUF file."""
    p = pathlib.Path(path)
    if is_gguf(p):
        # Built from the file's metadata: importing AutoConfig would import the package
        # of every transformers model (its lazy import table alone is a scan of them all).
        return gguf_hf_config(p)
    from transformers import AutoConfig

    if not (p / "config.json").is_file():
        raise ConfigError(f"model path {str(p)!r} has no config.json and is not a .gguf file")
    return AutoConfig.from_pretrained(p)


def resolve_model_class(hf_config: Any, model_refs: dict[str, str]) -> type[nn.Module]:
    """The registered model class for the first of the checkpoint's architectures we know."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in model_refs:
            model_cls: type[nn.Module] = import_ref(model_refs[arch])
            return model_cls
    raise UnknownArchitectureError(
        f"no model registered for architecture(s) {archs or '[none in config.json]'}. "
        f"Registered: {', '.join(sorted(model_refs)) or 'none'}. A plugin can add one "
        "with the register_models hook."
    )


def checkpoint_dtype(hf_config: Any) -> torch.dtype | None:
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and hasattr(torch, value):
        dtype: torch.dtype = getattr(torch, value)
        return dtype
    return None


# --- safetensors ----------------------------------------------------------------------


def iter_safetensors(path: str | pathlib.Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of ``model.safetensors`` or of the shards listed in its index file."""
    from safetensors import safe_open

    p = pathlib.Path(path)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (p / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        files = sorted(f.name for f in p.glob("*.safetensors"))
    if not files:
        raise MissingWeightsError(f"no safetensors weights found in {str(p)!r}")
    counts = []
    for name in files:  # the headers only: the bar's total
        with safe_open(str(p / name), framework="pt") as f:
            counts.append(len(f.keys()))
    with startup_log.progress_bar(sum(counts), "reading weights") as bar:
        for name in files:
            with safe_open(str(p / name), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    tensor = f.get_tensor(key)
                    if tensor.dtype in _FLOAT8:
                        # Copied into a float parameter it would load without its scales.
                        raise UnsupportedModelError(
                            f"checkpoint {str(p)!r} stores {key} as {tensor.dtype} "
                            f"(quantized weights), which enginecore does not support. "
                            f"Supported: {SUPPORTED_WEIGHTS}."
                        )
                    yield key, tensor
                    bar.update()


def iter_weights(
    path: str | pathlib.Path, hf_config: Any, keep_quantized: tuple[str, ...] = ()
) -> Iterator[tuple[str, Any]]:
    """A checkpoint's tensors under HF names. A linear method that keeps quantized blocks
    names their formats in ``keep_quantized``: GGUF block types, and ``INT4_BLOCKS`` for
    AWQ / GPTQ weights (de-quantized to float32 otherwise)."""
    if is_gguf(path):
        return iter_gguf(path, hf_config, keep_quantized)
    group_quant = group_quant_config(hf_config)
    if group_quant is not None:
        return iter_group_quantized(
            iter_safetensors(path), group_quant, INT4_BLOCKS in keep_quantized
        )
    return iter_safetensors(path)


# --- GGUF -----------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _gguf_reader(path: str) -> GGUFMetadata:
    """Reading the config and then the tensors share one reading of the header."""
    return GGUFMetadata(path)


def gguf_tensor_types() -> set[str]:
    """The GGUF tensor types the loader de-quantizes (through the ``gguf`` package)."""
    from gguf.quants import _type_traits

    return {"F32", "F16"} | {t.name for t in _type_traits}


def check_gguf_tensor_types(reader: Any, path: str | pathlib.Path) -> None:
    supported = gguf_tensor_types()
    found = sorted({t.tensor_type.name for t in reader.tensors} - supported)
    if found:
        raise UnsupportedModelError(
            f"GGUF file {str(path)!r} holds tensors of type {', '.join(found)}, which "
            f"enginecore cannot de-quantize (supported: {', '.join(sorted(supported))})"
        )


def gguf_hf_config(path: str | pathlib.Path) -> Any:
    """The HF-equivalent config of a GGUF file, read from its metadata."""
    reader = _gguf_reader(str(pathlib.Path(path).resolve()))
    check_gguf_tensor_types(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    return gguf_config(reader.field("general.architecture"), reader.field, tensors)


class _RopeRows(NamedTuple):
    """A Llama q/k weight's blocks in llama.cpp's rotary order, and its heads."""

    raw: torch.Tensor
    heads: int


class _RopeOrderedTensor(QuantizedTensor):
    """q/k blocks whose rows take HF's rotary order when first read: a linear method
    that finds the layer prepared never reads them, and reordering them read a quarter of
    a layer's bytes at every load."""

    def __init__(
        self, rows: _RopeRows, fmt: str, shape: tuple[int, int], source: str, start: int = 0
    ) -> None:
        self._rows, self._start = rows, start
        self.format, self.shape, self.source = fmt, shape, source

    @functools.cached_property
    def data(self) -> torch.Tensor:  # type: ignore[override]
        ordered = unpermute_rope(self._rows.raw, self._rows.heads)
        return ordered.narrow(0, self._start, self.shape[0])

    def stored_rows(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        if "data" in vars(self):  # already reordered
            return self.data, None
        raw = self._rows.raw
        order = unpermute_rope(torch.arange(raw.shape[0]), self._rows.heads)
        return raw, order.narrow(0, self._start, self.shape[0])

    def rows(self, start: int, length: int) -> QuantizedTensor:
        source = f"{self.source}[{start}:{start + length}]" if self.source else ""
        shape = (length, self.shape[1])
        return _RopeOrderedTensor(self._rows, self.format, shape, source, self._start + start)


# The token embedding and the output head: handed over in blocks too, each asks its linear
# method for a table (one kept from an earlier load, mapped) before de-quantizing it; a
# method that multiplies the blocks computes the logits from them.
EMBEDDING = "token_embd.weight"
HEAD = "output.weight"


def iter_gguf(
    path: str | pathlib.Path, hf_config: Any, keep_quantized: tuple[str, ...] = ()
) -> Iterator[tuple[str, Any]]:
    """GGUF tensors under HF names and in HF layouts: de-quantized, or, for a layer's 2-D
    projection in a block format named in ``keep_quantized``, its blocks (row order
    fixed like a float weight's) as a :class:`QuantizedTensor`; so are the token
    embedding and the output head in such a format."""
    reader = _gguf_reader(str(pathlib.Path(path).resolve()))
    arch = reader.field("general.architecture")
    for tensor in startup_log.progress(reader.tensors, len(reader.tensors), "reading weights"):
        shape = tuple(int(d) for d in reversed(tensor.shape))
        if (
            tensor.tensor_type.name in keep_quantized
            and (tensor.name.startswith("blk.") or tensor.name in (EMBEDDING, HEAD))
            and len(shape) == 2
        ):
            # Mapped, not read: a linear method with the blocks prepared never touches them.
            raw = reader.mapped(tensor).reshape(shape[0], -1)
            fmt = tensor.tensor_type.name
            for hf_name, rows in hf_tensors(arch, tensor.name, raw, hf_config, _RopeRows):
                if isinstance(rows, _RopeRows):
                    yield hf_name, _RopeOrderedTensor(rows, fmt, shape, hf_name)
                else:
                    yield hf_name, QuantizedTensor(rows, fmt, shape, hf_name)
            continue
        named = list(hf_tensors(arch, tensor.name, dequantized(tensor), hf_config))
        if not named:
            logger.debug("skipping GGUF tensor %s", tensor.name)
        yield from named
    reader.unmap()  # the pages the model did not keep are the page cache's again


__all__ = ["MissingWeightsError", "load_params"]
