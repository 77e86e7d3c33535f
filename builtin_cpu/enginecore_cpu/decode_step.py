"""A Llama-family decode step in one foreign call (``decode_step.c``).

At batch 1 a step of the demo model is about 4 ms of weight reads, but the layers spend
as much again between them: some 150 module calls and 300 ``ctypes`` calls of Python. For
a model whose classes declare the block this step computes (``enginecore.layers.decode_block``:
the Llama block, or Qwen3's with its QK norm; projections kept in blocks by the ``gguf`` linear method,
or float32 weights under the plain or ``cpu_packed`` method; float32 on CPU, one rank),
:class:`FusedDecodeStep` records each layer's weights and kernels once; a step whose
tokens are all decodes served by the ``cpu`` backend's dense mirror then runs as one call
of the same kernels on the same values, so its hidden states are the layers' bit for bit
(float32 products: BLAS's ``sgemm_``, which ``F.linear`` calls, on one thread each; the
layers' bits where torch runs one thread).
The call runs one OpenMP team whose threads take chunks of each product and of attention
from a shared counter (see ``decode_step.c``); the kernels are built into the step's own
library without their OpenMP loops (:data:`SERIAL_SOURCES`). Everything else (prompts,
mixed steps, other models and methods) takes the layers. ``ENGINECORE_FUSED_DECODE=0``
switches it off.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import threading
from ctypes import POINTER, Structure, c_float, c_int, c_int64, c_void_p
from pathlib import Path
from typing import Any

import numpy as np
import torch

from enginecore.block_formats.gguf_blocks import Q4_HALF_SCALES, BlockWeight
from enginecore.layers.attention import AttentionBatch
from enginecore.layers.decode_block import DecodeBlock, declared_block, declares_logits_head
from enginecore.layers.linear import UnquantizedLinearMethod
from enginecore_cpu import cpu_kernels, kquant_kernels, quant_gemm, quant_kernels
from enginecore_cpu.fused_ops import CpuFusedOps
from enginecore_cpu.gguf_linear_method import DIRECT_MAX_ROWS, gemm_from_rows
from enginecore_cpu.linear_method import CpuPackedLinearMethod
from enginecore_cpu.mirror_layout import geometry

logger = logging.getLogger(__name__)

SOURCE = cpu_kernels.SOURCE.with_name("decode_step.c")
ENV_SWITCH = "ENGINECORE_FUSED_DECODE"
_SUBBLOCK_KINDS = (5, 6)  # ecd_part.kind of Q5_K / Q6_K (KQuantWeight.kind)
_OFFSET_KINDS = (4, Q4_HALF_SCALES)  # 4-bit blocks whose offsets m are read (not Q4_0's)
_F32_ROWS, _F32_INPUT_MAJOR = 32, 33  # float32 weights, [out, in] or [in, out] in memory
_F32_KINDS = (_F32_ROWS, _F32_INPUT_MAJOR)
# The linear methods that multiply a float32 weight as it is stored (F.linear, or a packed
# copy of it): the step's sgemm computes what they do.
_PLAIN_METHODS = (UnquantizedLinearMethod, CpuPackedLinearMethod)


class _Kernels(Structure):
    _fields_ = [
        (name, c_void_p)
        for name in (
            "rms_norm",
            "rotary",
            "silu_and_mul",
            "write_kv",
            "mirror_append",
            "attention_spans",
            "attend_span",
            "merge_spans",
            "linear",
            "quantize_rows",
            "gemm_k",
            "gemm_q4",
            "gemm_q8",
            "gemm",
            "sgemm",
            "blas_threads_local",
            "argmax_rows",
        )
    ]


class _Part(Structure):
    _fields_ = [
        ("kind", c_int64),
        ("first", c_int64),
        ("rows", c_int64),
        ("qs", c_void_p),
        ("d", c_void_p),
        ("m", c_void_p),
        ("qs_row", c_int64),
        ("d_row", c_int64),
        ("m_row", c_int64),
        ("gemm_from", c_int64),
    ]


class _Proj(Structure):
    _fields_ = [
        ("input", c_int64),
        ("out", c_int64),
        ("num_parts", c_int64),
        ("parts", POINTER(_Part)),
        ("bias", c_void_p),
    ]


class _Layer(Structure):
    _fields_ = [
        ("input_norm", c_void_p),
        ("post_norm", c_void_p),
        ("q_norm", c_void_p),
        ("k_norm", c_void_p),
        ("qkv", _Proj),
        ("o", _Proj),
        ("gate_up", _Proj),
        ("down", _Proj),
        ("k_cache", c_void_p),
        ("v_cache", c_void_p),
        ("cache_slots", c_int64),
        ("window", c_int64),
    ]


class _Model(Structure):
    _fields_ = [
        ("k", _Kernels),
        *[
            (name, c_int64)
            for name in (
                "num_layers",
                "hidden",
                "heads",
                "kv_heads",
                "head_dim",
                "inter",
                "vocab",
                "max_pos",
            )
        ],
        ("eps", c_float),
        ("scale", c_float),
        ("embed", c_void_p),
        ("final_norm", c_void_p),
        ("cos", c_void_p),
        ("sin", c_void_p),
        ("layers", POINTER(_Layer)),
        ("head", _Proj),
        ("kv_type", c_int64),
    ]


class Unsupported(Exception):
    """Why a model cannot take the fused step (the layers serve it)."""


def _address(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), c_void_p).value or 0


def _kernels(
    lib: ctypes.CDLL, needs_blocks: bool, needs_subblocks: bool, needs_sgemm: bool
) -> _Kernels:
    """The kernels' addresses in the step's own library (their serial builds), where the
    layers' builds are switched on and load (the block kernels' only where a weight is in
    blocks); BLAS's ``sgemm_`` where a weight is float32."""
    if cpu_kernels.load() is None or (needs_blocks and quant_kernels.load() is None):
        raise Unsupported("the C kernels are off or could not be built")
    if needs_subblocks and kquant_kernels.load() is None:
        raise Unsupported("the K-quant kernel is off or could not be built")
    sgemm, threads_local = blas_sgemm() if needs_sgemm else (0, 0)
    if needs_sgemm and not sgemm:
        raise Unsupported("float32 projections and no BLAS sgemm_ in torch's library")
    return _Kernels(
        sgemm=sgemm,
        blas_threads_local=threads_local,
        **{
            field: _address(lib, name)
            for field, name in (
                ("rms_norm", "ec_rms_norm"),
                ("rotary", "ec_rotary"),
                ("silu_and_mul", "ec_silu_and_mul"),
                ("write_kv", "ec_write_kv"),
                ("mirror_append", "ec_mirror_append"),
                ("attention_spans", "ec_attention_spans"),
                ("attend_span", "ec_attend_span"),
                ("merge_spans", "ec_merge_spans"),
                ("linear", "ecq_linear"),
                ("quantize_rows", "ecq_quantize_rows"),
                ("gemm_k", "eck_gemm_k"),
                ("gemm_q4", "ecq_gemm_q4"),
                ("gemm_q8", "ecq_gemm_q8"),
                ("gemm", "ecg_gemm"),
                ("argmax_rows", "ec_argmax_rows"),
            )
        },
    )


def blas_sgemm() -> tuple[int, int]:
    """The addresses of the ``sgemm_`` torch's CPU library exports (MKL's on x86 wheels),
    which ``F.linear`` also reaches, and of MKL's ``MKL_Set_Num_Threads_Local``; 0 for
    either it lacks."""
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    except OSError:
        return 0, 0
    found = []
    for name in ("sgemm_", "MKL_Set_Num_Threads_Local"):
        try:
            found.append(_address(lib, name))
        except AttributeError:
            found.append(0)
    return found[0], found[1]


def _pointer(tensor: torch.Tensor | None, what: str) -> int:
    if tensor is None:
        return 0
    if tensor.dtype != torch.float32 or tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise Unsupported(f"{what} is not a contiguous float32 CPU tensor")
    return tensor.data_ptr()


def _row_bytes(part: Any) -> tuple[int, int, int]:
    """Bytes a weight row takes in each array a kernel reads (values, scales, offsets; 0
    for offsets it does not read), so that a thread can start at any row."""
    reads_offsets = isinstance(part, BlockWeight) and part.kind in _OFFSET_KINDS
    tensors = [part.qs, part.d if isinstance(part, BlockWeight) else part.scales]
    if reads_offsets:
        tensors.append(part.m)
    sizes = []
    for tensor in tensors:
        if tensor.shape[0] != part.shape[0] or not tensor.is_contiguous():
            raise Unsupported("a weight part whose arrays are not contiguous rows")
        sizes.append(tensor[0].numel() * tensor.element_size())
    return sizes[0], sizes[1], sizes[2] if reads_offsets else 0


class FusedDecodeStep:
    """The recorded model; :meth:`run` computes one all-decode step."""

    def __init__(self, model: Any, kv_caches: list[torch.Tensor], backend: Any) -> None:
        self.backend = backend  # the ``cpu`` attention backend, whose mirror serves decodes
        self.steps = 0  # steps run fused (the tests check the path is taken)
        # Each part's products take the many-row kernel from the rows the layers' do
        # (the crossover of its format on this build), so the step stays the layers' bits.
        gemm = quant_gemm.load()
        self._vnni = gemm.vnni if gemm is not None else None
        self.many_row_steps = 0  # steps of as many rows as some part's crossover
        self.max_rows = 1 << 62  # the most rows a step takes (fewer with block weights)
        self._many_rows_from = DIRECT_MAX_ROWS + 1
        self._keep: list[Any] = []  # ctypes arrays the C structures point into
        self._mirror_layers: list[torch.Tensor] | None = None
        self._mirror_ptrs: Any = None
        self._mirror_shape: Any = None  # row stride, chunk, chunk stride, capacity
        self._out: torch.Tensor | None = None  # a step with its head: the hidden states
        self.lib = _load()
        self.model = self._record(model, kv_caches)
        # Whether the step computes the logits too (``run``'s ``head``), and the steps it
        # did so, with the logits out or their argmax alone.
        self.has_head = self.model.head.num_parts > 0
        self.logits_steps = 0
        self.token_steps = 0

    def use_library(self, lib: ctypes.CDLL) -> None:
        """Runs the step from another build of its library (a benchmark's, built with
        other flags): the step calls its kernels through the addresses recorded at start,
        so these are taken from ``lib`` too, or the build's flags would reach the step's
        own code but not its kernels. BLAS's ``sgemm_`` is kept."""
        kernels = _Kernels.from_buffer_copy(self.model.k)
        own = _kernels(lib, False, False, False)
        for field, *_ in _Kernels._fields_:
            if field not in ("sgemm", "blas_threads_local"):
                setattr(kernels, field, getattr(own, field))
        self.lib, self.model.k = lib, kernels

    # --- recording --------------------------------------------------------------------

    def _record(self, model: Any, kv_caches: list[torch.Tensor]) -> _Model:
        # The decoder stack, read by its declared block's layout (a backend names no model class).
        stack: Any = getattr(model, "model", None)
        block = declared_block(stack)
        if block is None:
            raise Unsupported(f"{type(model).__name__} declares no fused decode block")
        # The step stands in for the causal LM's forward: only where its own class says
        # that forward is its stack's (a subclass, a plugin's model, may do more).
        if declared_block(model) is not block:
            raise Unsupported(f"{type(model).__name__} does not declare its stack's block")
        if stack.parallel.tp_size != 1 or stack.parallel.pp_size != 1:
            raise Unsupported("the model is split over ranks")
        layers = list(stack.layers)
        if len(kv_caches) != len(layers):
            raise Unsupported("KV cache groups share layers' caches")
        rotary = stack.rotary
        if rotary.rot_dim != rotary.head_dim or not isinstance(rotary.fused_ops, CpuFusedOps):
            raise Unsupported("partial or unfused rotary embedding")
        embed = stack.embed_tokens.weight
        first = layers[0].self_attn
        heads, kv_heads, head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        if not cpu_kernels.decode_attention_fits(heads // kv_heads, head_dim):
            raise Unsupported("head sizes beyond the decode attention kernel")
        inter = layers[0].mlp.down_proj.input_size
        records = [
            self._layer(layer, cache, block, (heads, kv_heads, head_dim, inter), stack.norm.eps)
            for layer, cache in zip(layers, kv_caches, strict=True)
        ]
        head, head_parts = self._head(model)
        parts = [p for rec in records for p in rec[1]] + head_parts
        needs_subblocks = any(p.kind in _SUBBLOCK_KINDS for p in parts)
        needs_sgemm = any(p.kind in _F32_KINDS for p in parts)
        needs_blocks = any(p.kind not in _F32_KINDS for p in parts)
        # Steps of any size where every weight is float32 (sgemm takes any rows); blocks
        # keep the rows up to which the layers' kernels are the step's.
        if needs_blocks:
            self.max_rows = DIRECT_MAX_ROWS
        array = (_Layer * len(records))(*(rec[0] for rec in records))
        self._keep.append(array)
        return _Model(
            k=_kernels(self.lib, needs_blocks, needs_subblocks, needs_sgemm),
            num_layers=len(records),
            hidden=embed.shape[1],
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            inter=inter,
            vocab=embed.shape[0],
            max_pos=rotary.cos.shape[0],
            eps=stack.norm.eps,
            scale=first.attn.scale,
            embed=_pointer(embed, "the embedding"),
            final_norm=_pointer(stack.norm.weight, "the final norm"),
            cos=_pointer(rotary.cos, "the rotary table"),
            sin=_pointer(rotary.sin, "the rotary table"),
            layers=array,
            head=head,
            kv_type=cpu_kernels.KV_TYPES[kv_caches[0].dtype],
        )

    def _head(self, model: Any) -> tuple[_Proj, list[_Part]]:
        """The LM head as the step's last product, where the model declares its logits
        are that product alone (``declares_logits_head``) and the head is a weight the
        step multiplies as the head's linear method does; else none (an empty
        projection: the runner computes the logits from the hidden states)."""
        head = model.logits_head() if declares_logits_head(model) else None
        if head is None or head.parallel.tp_size != 1:
            return _Proj(0, 0, 0, None, None), []
        parts: list[_Part] = []
        try:
            proj = self._proj(head, parts)
        except Unsupported as exc:
            logger.debug("the LM head runs after the fused step: %s", exc)
            return _Proj(0, 0, 0, None, None), []
        return proj, parts

    def _layer(
        self,
        layer: Any,
        cache: torch.Tensor,
        block: DecodeBlock,
        sizes: tuple[int, int, int, int],
        eps: float,
    ) -> tuple[_Layer, list[_Part]]:
        attn, mlp = layer.self_attn, layer.mlp
        if (
            declared_block(layer) is not block
            or declared_block(attn) is not block
            or declared_block(mlp) is not DecodeBlock.LLAMA
            or mlp.activation is not None
        ):
            raise Unsupported(f"{type(layer).__name__} is not the declared block with SiLU")
        qk_norms = [attn.q_norm, attn.k_norm] if block is DecodeBlock.LLAMA_QK_NORM else []
        if (attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.down_proj.input_size) != sizes:
            raise Unsupported("layers of different sizes")
        if attn.attn.logits_soft_cap is not None:
            raise Unsupported("soft-capped attention scores")
        for norm in (layer.input_layernorm, layer.post_attention_layernorm, *qk_norms):
            if not isinstance(norm.fused_ops, CpuFusedOps) or norm.eps != eps:
                raise Unsupported("norms without the fused kernel")
        if cache.dtype not in cpu_kernels.KV_TYPES or not cache.is_contiguous():
            raise Unsupported(f"a {cache.dtype} KV cache")
        if cache.dtype != self.backend.mirror.dtype:
            raise Unsupported("a decode mirror of another dtype than the KV cache")
        parts: list[_Part] = []
        projs = [
            self._proj(attn.qkv_proj, parts),
            self._proj(attn.o_proj, parts),
            self._proj(mlp.gate_up_proj, parts),
            self._proj(mlp.down_proj, parts),
        ]
        half = cache[0].numel()
        record = _Layer(
            _pointer(layer.input_layernorm.weight, "a norm"),
            _pointer(layer.post_attention_layernorm.weight, "a norm"),
            *([_pointer(norm.weight, "a QK norm") for norm in qk_norms] or [0, 0]),
            *projs,
            cache.data_ptr(),
            cache.data_ptr() + half * cache.element_size(),
            half // (attn.num_kv_heads * attn.head_dim),
            attn.attn.sliding_window or 0,
        )
        return record, parts

    def _proj(self, linear: Any, all_parts: list[_Part]) -> _Proj:
        blocks = getattr(linear, "gguf_blocks", None)
        if not blocks:
            return self._f32_proj(linear, all_parts)
        parts = []
        for first, part in blocks:
            gemm_from = 1 << 62  # never: the layers have no many-row kernel either
            if self._vnni is not None:
                gemm_from = gemm_from_rows(part, self._vnni)
                self._many_rows_from = min(self._many_rows_from, gemm_from)
            parts.append(
                _Part(part.kind, first, part.shape[0], *part.pointers, *_row_bytes(part), gemm_from)
            )
        array = (_Part * len(parts))(*parts)
        self._keep.append(array)
        all_parts.extend(parts)
        k = blocks[0][1].shape[1]
        n = sum(part.shape[0] for _, part in blocks)
        return _Proj(k, n, len(parts), array, _pointer(getattr(linear, "bias", None), "a bias"))

    def _f32_proj(self, linear: Any, all_parts: list[_Part]) -> _Proj:
        """A projection whose float32 weight the layers multiply as it is (``F.linear``
        under the plain or ``cpu_packed`` linear method): one part for sgemm."""
        if type(linear.linear_method) not in _PLAIN_METHODS:
            raise Unsupported(f"a projection under {type(linear.linear_method).__name__}")
        weight = linear.weight
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
            raise Unsupported("a projection neither in blocks nor a float32 CPU weight")
        out, k = weight.shape
        if weight.is_contiguous():
            kind, lead = _F32_ROWS, k
        elif weight.t().is_contiguous():
            kind, lead = _F32_INPUT_MAJOR, out
        else:
            raise Unsupported("a float32 weight neither row-major nor input-major")
        part = _Part(kind, 0, out, weight.data_ptr(), None, None, lead, 0, 0, 1 << 62)
        array = (_Part * 1)(part)
        self._keep.append(array)
        all_parts.append(part)
        return _Proj(k, out, 1, array, _pointer(getattr(linear, "bias", None), "a bias"))

    # --- per step ---------------------------------------------------------------------

    def _scratch_out(self, n: int) -> torch.Tensor:
        """[n, hidden] float32 hidden states a step with its head writes and nobody reads:
        one buffer, grown to the most rows seen."""
        if self._out is None or self._out.shape[0] < n:
            self._out = torch.empty((max(n, 16), self.model.hidden), dtype=torch.float32)
        return self._out[:n]

    def handles(self, batch: AttentionBatch) -> bool:
        """Whether this step is all decodes, served from the mirror, no more than
        ``DIRECT_MAX_ROWS`` (the layers' limit without the many-row kernel)."""
        n = len(batch.req_ids)
        return self.backend.decodes_mirrored() and 0 < n == batch.num_decodes <= self.max_rows

    def run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        threads: int | None = None,
        head: str | None = None,
        tokens_into: np.ndarray | None = None,
    ) -> torch.Tensor:
        """The final normed hidden states [n, hidden] of the step's decode tokens, on
        ``threads`` threads (default: torch's); with ``head`` (where ``has_head``), the
        model's logits [n, vocab] (``"logits"``: ``compute_logits``' bits on one thread)
        or each row's argmax of them (``"tokens"``: int64 [n], ties and NaN as
        ``torch.argmax``), computed tile by tile without the logits. ``tokens_into``
        (with ``"tokens"``): a C-contiguous int64 array of at least n entries the tokens
        are written to, returned as a tensor over it (the caller's reused buffer: the
        step then makes and frees no tensor)."""
        if head not in (None, "logits", "tokens") or (head is not None and not self.has_head):
            raise ValueError(f"the fused step cannot give {head!r}")
        n = ids.shape[0]
        if tokens_into is not None and (
            head != "tokens"
            or tokens_into.dtype != np.int64
            or not tokens_into.flags.c_contiguous
            or tokens_into.shape[0] < n
        ):
            raise ValueError("tokens_into takes head='tokens' and a contiguous int64 [n] array")
        mirror = self.backend.mirror
        step = mirror.step
        if mirror.layers is not self._mirror_layers:  # grown (or first use): new addresses
            ptrs: list[int] = []
            for layer in mirror.layers:
                at = geometry(layer)
                ptrs += [at.k, at.v]
            self._mirror_ptrs = (c_void_p * len(ptrs))(*ptrs)
            shape = (at.row_stride, at.chunk, at.chunk_stride, at.capacity)
            self._mirror_shape = (c_int64 * 4)(*shape)
            self._mirror_layers = mirror.layers
        # With a head the hidden states are the call's scratch: one array, reused.
        out = (
            torch.empty((n, self.model.hidden), dtype=torch.float32)
            if head is None
            else self._scratch_out(n)
        )
        vocab = self.model.head.out
        logits = torch.empty((n, vocab), dtype=torch.float32) if head == "logits" else None
        tokens = None
        if head == "tokens":
            tokens = (
                torch.from_numpy(tokens_into[:n])
                if tokens_into is not None
                else torch.empty(n, dtype=torch.int64)
            )
        slots = np.ascontiguousarray(batch.slot_mapping, dtype=np.int64)
        status = self.lib.ecd_decode_step(
            ctypes.byref(self.model), n, ids.data_ptr(), positions.data_ptr(),
            slots.ctypes.data, step.lens.data_ptr(), self._mirror_ptrs,
            self._mirror_shape, out.data_ptr(),
            None if logits is None else logits.data_ptr(),
            None if tokens is None else tokens.data_ptr(), threads or torch.get_num_threads(),
        )  # fmt: skip
        if status == -2:
            raise MemoryError(f"no scratch memory for a decode step of {n} rows")
        if status:
            raise IndexError("fused decode step: a token id, position, slot or length out of range")
        self.steps += 1
        self.many_row_steps += n >= self._many_rows_from
        if logits is not None:
            self.logits_steps += 1
            return logits
        if tokens is not None:
            self.token_steps += 1
            return tokens
        return out


# The kernels the step calls, compiled into its library without their own OpenMP
# teams: the step's team splits the work, and starting an inner team (even of one
# thread) costs more than many of these small calls' work.
SERIAL_SOURCES = (
    cpu_kernels.SOURCE,
    quant_kernels.SOURCE,
    kquant_kernels.SOURCE,
    quant_gemm.SOURCE,
)


def build(extra_flags: tuple[str, list[str]] | None = None, only_path: bool = False) -> Path:
    """Compile ``decode_step.c`` with the kernels it calls into the cache (if not there
    yet); its path. ``extra_flags``: a name suffix and compiler flags added to the
    build's (the profiling build of ``benchmarks/decode_step_phases.py``); ``only_path``:
    the path without compiling (whether it exists says whether the build has landed)."""
    # The instructions the layers' many-row kernel is built with (AVX-512 VNNI, or
    # AVX-VNNI on an AVX2 CPU): the step holds its own build of it, and picks it from the
    # same crossover rows (``gemm_from_rows``), so the two builds must agree.
    isa = quant_gemm.extra_isa()
    if extra_flags is not None:
        isa = (f"{isa[0]}-{extra_flags[0]}", isa[1] + extra_flags[1]) if isa else extra_flags
    return cpu_kernels.build(
        source=SOURCE,
        stem="enginecore_decode_step",
        extra_isa=isa,
        serial_sources=SERIAL_SOURCES,
        only_path=only_path,
    )


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def _load() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL(str(build()))
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                raise Unsupported(f"decode_step.c could not be built: {exc}") from exc
            lib.ecd_decode_step.argtypes = [
                c_void_p, c_int64, *[c_void_p] * 9, c_int,
            ]  # fmt: skip
            lib.ecd_decode_step.restype = c_int
            _lib = lib
    return _lib


def fused_decode_step(
    model: Any, kv_caches: list[torch.Tensor], backend: Any
) -> FusedDecodeStep | None:
    """The fused step for ``model`` under the ``cpu`` attention ``backend``, or None
    (saying why at debug level) where the layers must run: switched off, no decode mirror
    (KV cache groups), or a model this step does not recognize."""
    if cpu_kernels.switched_off(ENV_SWITCH) or backend.mirror is None:
        return None
    try:
        return FusedDecodeStep(model, kv_caches, backend)
    except Unsupported as exc:
        logger.debug("decode steps run layer by layer: %s", exc)
        return None
