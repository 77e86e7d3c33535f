"""The torch model runner: scheduler deltas in, sampled tokens out.

The runner keeps each request's state (tokens, block table, sampling params, seeded
generator) across steps; the scheduler sends only what changed. The runner is the
authority on sampled tokens: a request's next input token is the last token this runner
sampled for it, which is what lets the scheduler plan step N+1 before it has seen step
N's tokens (async scheduling).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from dataclasses import dataclass, field
from itertools import compress
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from enginecore import startup_log
from enginecore.config import EngineConfig
from enginecore.distributed import SINGLE_RANK, ParallelContext
from enginecore.engine.inputs_staged import mark_inputs_staged
from enginecore.errors import ConfigError, EngineCoreError, UnsupportedModelError
from enginecore.interfaces import (
    AttentionBackend,
    AttentionSpec,
    LinearMethod,
    ModelRunner,
    WorkerSpec,
)
from enginecore.layers import (
    Attention,
    AttentionBatch,
    AttentionContext,
    LinearBase,
    VocabParallelEmbedding,
    install_fused_ops,
    use_linear_method,
)
from enginecore.layers.preparation_watch import PreparationWatch
from enginecore.layers.selection import (
    registered_refs,
    select_attention_backend,
    select_linear_method,
)
from enginecore.lora.manager import LoRAManager
from enginecore.params import SamplingParams
from enginecore.registry import import_ref
from enginecore.runner_output import ModelRunnerOutput
from enginecore.scheduler_output import GrammarOutput, SchedulerOutput
from enginecore.staging import DeviceEvents, HostCopy, StagingBuffer
from enginecore.worker_component_errors import build_worker_component, worker_component_error
from enginecore_models.block_table import BlockTable
from enginecore_models.checkpoint_support import (
    check_supported_checkpoint,
    unsupported_feature,
)
from enginecore_models.cuda_graphs import (
    DecodeGraphs,
    graphs_apply,
    measure_graph_memory,
    piecewise_graphs_apply,
)
from enginecore_models.drafter import Drafter, TokenBuffer
from enginecore_models.group_quant import group_quant_config
from enginecore_models.kv_connector_bridge import KVConnectorBridge
from enginecore_models.lora_support import make_lora_manager, note_fused_decode_off
from enginecore_models.per_request import (
    any_set,
    lookup,
    lookup_ints,
)
from enginecore_models.persistent_batch import PersistentBatch
from enginecore_models.piecewise_graphs import CudaGraphSeam, PiecewiseGraphs
from enginecore_models.prompt_logprobs import PromptLogprobsAccumulator
from enginecore_models.runner_sampling import SamplingPhase, StepState
from enginecore_models.sampler import (
    Sampler,
)
from enginecore_models.steady_decode import SteadyDecode
from enginecore_models.weight_loader import (
    checkpoint_dtype,
    is_gguf,
    iter_weights,
    load_hf_config,
    resolve_model_class,
)

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The step arrays' dtypes, as torch's (staging buffers are made per dtype).
_TORCH_DTYPES = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.bool_): torch.bool,
}


@runtime_checkable
class HasLogitsHead(Protocol):
    """A model that computes logits says with which weight (its LM head or the tied
    embedding), so that weight is prepared with the linear layers."""

    def logits_head(self) -> VocabParallelEmbedding: ...


@dataclass
class RequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # (how many of its tokens are in the KV cache: the persistent batch's ``computed``)
    output_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # prompt + outputs
    generator: torch.Generator | None = None
    # Set while prompt logprobs are being gathered (requests that asked for them).
    prompt_logprobs: PromptLogprobsAccumulator | None = None
    # Speculative decoding: drafts proposed after the last step, and the token array
    # the proposer searches.
    drafts: list[int] = field(default_factory=list)
    token_buffer: TokenBuffer | None = None


class _BatchView:
    """Request id -> (context length, block ids), for a backend ordering its decodes;
    ``context_lens_array`` gives the lengths of many requests as one array."""

    def __init__(
        self,
        batch: PersistentBatch,
        table: BlockTable,
        known: tuple[list[str], np.ndarray] | None = None,
    ) -> None:
        self.batch, self.table = batch, table
        self.known = known  # requests whose lengths the caller has already gathered

    def __getitem__(self, req_id: str) -> tuple[int, np.ndarray]:
        return int(self.batch.computed[self.batch.row_of[req_id]]), self.table.block_ids(req_id)

    def context_lens_array(self, req_ids: list[str]) -> np.ndarray:
        """``[self[r][0] for r in req_ids]`` as an int64 array, without reading block ids."""
        if self.known is not None and self.known[0] is req_ids:
            return self.known[1]
        lens: np.ndarray = self.batch.computed[lookup_ints(self.batch.row_of, req_ids)]
        return lens


class TorchModelRunner(SamplingPhase, ModelRunner):
    samples_tokens = True  # the pooling runner computes no logits

    def __init__(
        self,
        config: EngineConfig,
        worker_spec: WorkerSpec,
        device: torch.device | str | None = None,
        parallel: ParallelContext = SINGLE_RANK,
    ) -> None:
        self.config = config
        self.worker_spec = worker_spec
        self.device = torch.device(device if device is not None else "cpu")
        self.parallel = parallel
        # Unset: the attention backend's, set when it is chosen (_make_attention_backend).
        self.block_size = config.cache.tokens_per_block
        self.model: Any = None
        self.hf_config: Any = None
        self.dtype = torch.float32
        self.kv_caches: list[torch.Tensor] | None = None
        self.attn_backend: AttentionBackend | None = None
        self.decode_graphs: DecodeGraphs | None = None  # CUDA only (cuda_graphs.py)
        # Multi-token steps replayed in pieces (piecewise_graphs.py; model.piecewise_cuda_graphs).
        self.piecewise_graphs: PiecewiseGraphs | None = None
        self.fused_decode: Any = None  # the backend's whole decode step, where it has one
        self.num_blocks = 0
        self.requests: dict[str, RequestState] = {}
        # KV cache groups (see get_kv_cache_groups): each group's sliding window, and
        # per layer its group and the cache tensor it uses. One group until grouped.
        self.kv_cache_group_windows: list[int | None] = [None]
        self._hybrid_kv_cache = False  # groups asked for (kept across a reload on wake-up)
        self._layer_groups: list[int] = []
        self._layer_slots: list[int] = []
        self.block_tables = [BlockTable()]
        self.block_table = self.block_tables[0]
        self._step: StepState | None = None
        # A step of decodes only (one token per request, no drafts) takes its inputs in
        # a few array operations; the switch and the count are for the tests that compare
        # it with the general path and check it is taken.
        self.decode_shortcut = True
        self.decode_shortcut_steps = 0
        # A step of decodes with the same requests as the last one reuses what that step
        # looked up (steady_decode.py); counted for the tests, off with decode_shortcut.
        self._steady: SteadyDecode | None = None
        self.steady_decode_steps = 0
        self._free_after_sampling: list[torch.Tensor] = []  # a steady step's hidden states
        # The fused step's greedy tokens, written by the call into this host array (read
        # by this step's sample_tokens, before the next step's call): no tensor made,
        # freed or copied per step.
        self._fused_tokens = np.empty(config.scheduler.max_num_seqs, dtype=np.int64)
        self.greedy_shortcut = True  # sample_tokens' argmax-only path (tests turn it off)
        self.greedy_shortcut_steps = 0
        self.sampler = Sampler(self._make_generator(config.model.seed))
        self.eos_token_ids: list[int] = []
        # The running requests' rows (persistent_batch.py), made once the vocabulary is
        # known; the step's inputs staged through double-buffered host memory; the
        # step's one device-to-host copy.
        self.batch: PersistentBatch | None = None
        self.events = DeviceEvents(self.device)
        spec = config.speculative
        rows = config.scheduler.max_num_seqs * (
            1 + (spec.num_speculative_tokens if spec.enabled else 0)
        )
        self.host_copy = HostCopy(self.events, self.device, min_rows=rows)
        self._staging: dict[str, StagingBuffer] = {}
        self.kv_connector: KVConnectorBridge | None = None
        self.drafter: Drafter | None = None
        self.lora: LoRAManager | None = None  # LoRA adapters (enable_lora)
        if config.speculative.enabled and worker_spec.spec_decode_proposer_ref:
            self.drafter = Drafter(config, worker_spec.spec_decode_proposer_ref, worker_spec)

    # --- loading --------------------------------------------------------------------

    def _make_generator(self, seed: int) -> torch.Generator:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        return gen

    def _resolve_dtype(self) -> torch.dtype:
        wanted = self.config.model.dtype
        if wanted != "auto":
            return _DTYPES[wanted]
        if self.device.type == "cpu":
            return torch.float32  # CPU matmuls in half precision are slow and lossy
        native = checkpoint_dtype(self.hf_config)
        if native in (torch.bfloat16, torch.float16):
            return native
        # float32 checkpoints and GGUF files: a GPU serves them in half precision.
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    def load_model(self) -> None:
        path = self.config.model.path
        if not path:
            raise ConfigError(
                "model path is empty: set 'model' to a checkpoint directory or .gguf file"
            )
        self.hf_config = load_hf_config(path)
        check_supported_checkpoint(self.hf_config, path)
        model_cls = self._model_class()
        self.dtype = self._resolve_dtype()
        configured = self.config.model.max_model_len
        native = self._checkpoint_max_len()
        if configured is not None and native is not None and configured > native:
            raise ConfigError(
                f"max_model_len={configured} exceeds the checkpoint's limit of {native} "
                "positions (max_position_embeddings / n_positions)"
            )
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        refs = self.worker_spec.linear_method_refs or registered_refs("linear_method")
        method_cls = select_linear_method(
            self.device.type,
            str(self.dtype).removeprefix("torch."),
            refs,
            self._linear_method_name(path, refs),
        )
        method = build_worker_component(
            "linear_method", method_cls, refs, self.worker_spec, self.config
        )
        try:
            with torch.device(self.device), use_linear_method(method):
                model = model_cls(self.hf_config, self.parallel, self.dtype)
        except (NotImplementedError, UnsupportedModelError) as exc:
            raise unsupported_feature(self.hf_config, path, exc) from exc
        except EngineCoreError:
            raise
        except Exception as exc:  # the model plugin's own failure, named as the model's
            architecture = (getattr(self.hf_config, "architectures", None) or ["?"])[0]
            raise worker_component_error("model", architecture, self.worker_spec, exc) from exc
        startup_log.logger.info("loading weights from %s", path)
        started = time.perf_counter()
        keep = method_cls.gguf_formats
        self._load_weights(model, path, keep)
        layers = self._weighted_layers(model)
        names = {id(m): n for n, m in model.named_modules()}
        with PreparationWatch(method) as watch:
            for layer in startup_log.progress(layers, len(layers), "preparing weights", " layers"):
                watch.started(names.get(id(layer), type(layer).__name__))
                layer.linear_method.process_weights_after_loading(layer)
        startup_log.logger.info(
            "weights loaded and prepared by %s in %.1f s",
            method_cls.name,
            time.perf_counter() - started,
        )
        self.model = model.eval()
        # One group until the engine asks for groups (get_kv_cache_groups).
        self._group_layers(self._hybrid_kv_cache)
        self._set_attention_backend()
        if self.config.lora.enable_lora:
            self.lora = make_lora_manager(self)
        eos = getattr(self.hf_config, "eos_token_id", None)
        self.eos_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
        logger.info(
            "loaded %s (%s) on %s as %s; attention: %s, linear method: %s",
            type(model).__name__,
            path,
            self.device,
            str(self.dtype).removeprefix("torch."),
            self.attn_backend.name if self.attn_backend else "none (an encoder)",
            method_cls.name,
        )

    def _model_class(self) -> type[torch.nn.Module]:
        return resolve_model_class(self.hf_config, self.worker_spec.model_refs)

    def _load_weights(self, model: Any, path: str, keep: tuple[str, ...]) -> None:
        model.load_weights(iter_weights(path, self.hf_config, keep))

    def _linear_method_name(self, path: str, refs: dict[str, str]) -> str:
        return linear_method_name(
            self.config, path, self.hf_config, self.device.type, self.dtype, refs
        )

    def _weighted_layers(self, model: torch.nn.Module) -> list[LinearBase | VocabParallelEmbedding]:
        """The linear layers, and the LM head where this stage computes logits (a head
        tied to the embedding is the embedding)."""
        layers: list[LinearBase | VocabParallelEmbedding] = [
            m for m in model.modules() if isinstance(m, LinearBase)
        ]
        if self.parallel.is_last_pp_rank and isinstance(model, HasLogitsHead):
            head = model.logits_head()
            if isinstance(head, VocabParallelEmbedding):
                layers.append(head)
        return layers

    def _hybrid_kv_cache_possible(self) -> bool:
        # A pipeline stage holds only some layers, and a KV connector moves one table.
        return self.parallel.pp_size == 1 and not self.worker_spec.kv_connector_ref

    def _group_layers(self, hybrid: bool) -> None:
        """Split the attention layers into KV cache groups, as vLLM's hybrid allocator.

        Without sliding layers (or ``hybrid`` off) there is one group of every layer,
        each with its own cache tensor, the window a mask. Otherwise layers with the same
        window form groups of ``n`` layers, ``n`` the fewest layers of any window: a
        block then holds ``n`` layers' K/V, and layer ``i`` of every group shares cache
        tensor ``i``. A block belongs to one group at a time, so sharing is safe, and
        a sliding group needs only its window's blocks.
        """
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        windows = [a.sliding_window for a in layers]
        if not hybrid or all(w is None for w in windows):
            self.kv_cache_group_windows = [None]
            self._layer_groups = [0] * len(layers)
            self._layer_slots = list(range(len(layers)))
        else:
            # Full attention first: group 0 is then the one that holds every block.
            kinds = sorted(set(windows), key=lambda w: -1 if w is None else w)
            by_kind = {w: [i for i, x in enumerate(windows) if x == w] for w in kinds}
            size = min(len(v) for v in by_kind.values())
            self.kv_cache_group_windows = []
            self._layer_groups = [0] * len(layers)
            self._layer_slots = [0] * len(layers)
            for w in kinds:
                members = by_kind[w]
                for start in range(0, len(members), size):
                    group = len(self.kv_cache_group_windows)
                    self.kv_cache_group_windows.append(w)
                    for slot, i in enumerate(members[start : start + size]):
                        self._layer_groups[i] = group
                        self._layer_slots[i] = slot
        for layer, group in zip(layers, self._layer_groups, strict=True):
            layer.kv_cache_group = group
        self.block_tables = [BlockTable() for _ in self.kv_cache_group_windows]
        self.block_table = self.block_tables[0]

    def get_kv_cache_groups(self, allow_hybrid: bool = True) -> list[int | None] | None:
        if self.kv_caches is not None:
            raise EngineCoreError("KV cache groups are laid out before the cache is allocated")
        hybrid = allow_hybrid and self._hybrid_kv_cache_possible()
        self._hybrid_kv_cache = hybrid
        before = self.kv_cache_group_windows
        self._group_layers(hybrid)
        if self.kv_cache_group_windows != before:
            self._set_attention_backend()  # its spec counts cache tensors and groups
        windows = self.kv_cache_group_windows
        return None if windows == [None] else list(windows)

    def _backend(self) -> AttentionBackend:
        """The attention backend; only an encoder-only model runs without one."""
        if self.attn_backend is None:
            raise RuntimeError("this model runs without an attention backend (an encoder)")
        return self.attn_backend

    def _set_attention_backend(self) -> None:
        self.attn_backend = self._make_attention_backend(self.model)
        fused = self.attn_backend.fused_ops()
        if fused is not None:
            install_fused_ops(self.model, fused)
            self.sampler.fused_ops = fused

    def _make_attention_backend(self, model: torch.nn.Module) -> AttentionBackend:
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        if not layers:
            raise ConfigError(f"{type(model).__name__} has no enginecore.layers.Attention layer")
        spec = AttentionSpec(
            # Cache tensors: layers of different KV cache groups share them.
            num_layers=max(self._layer_slots, default=len(layers) - 1) + 1,
            num_kv_cache_groups=len(self.kv_cache_group_windows),
            num_heads=layers[0].num_heads,
            num_kv_heads=layers[0].num_kv_heads,
            head_dim=layers[0].head_dim,
            dtype=self.dtype,
            device=self.device,
            block_size=self.block_size,
            max_model_len=self.get_max_model_len(),
            max_num_seqs=self.config.scheduler.max_num_seqs,
            max_num_batched_tokens=self._max_num_batched_tokens(),
            sliding_window=any(a.sliding_window is not None for a in layers),
            logits_soft_cap=any(a.logits_soft_cap is not None for a in layers),
            kv_dtype=self._kv_dtype(),
        )
        auto_block_size = self.config.cache.block_size is None
        refs = self.worker_spec.attention_backend_refs or registered_refs("attention_backend")
        backend_cls = select_attention_backend(
            spec, refs, self.config.model.attention_backend, auto_block_size=auto_block_size
        )
        if auto_block_size:
            self.block_size = backend_cls.default_block_size
            spec = dataclasses.replace(spec, block_size=self.block_size)
        if self._gguf_half_kv():
            half = dataclasses.replace(spec, kv_dtype=torch.float16)
            if backend_cls.capabilities.kv_cache_reason(half) is None:
                spec = half
        return build_worker_component(
            "attention_backend", backend_cls, refs, self.worker_spec, spec
        )

    def _gguf_half_kv(self) -> bool:
        """Whether ``cache.kv_cache_dtype: auto`` keeps the K/V in float16: a GGUF file
        served in float32 on CPU. Its weights are already rounded to a few bits, and
        llama.cpp, whose files these are, keeps K/V in float16: half the bytes each
        decode step reads beside the weights, twice the context in the same memory.
        A float checkpoint keeps its K/V in its dtype, token for token with transformers.
        Only where the backend keeps float16 (the caller checks)."""
        return (
            self.config.cache.kv_cache_dtype == "auto"
            and self.device.type == "cpu"
            and self.dtype == torch.float32
            and is_gguf(self.config.model.path)
        )

    def _kv_dtype(self) -> torch.dtype | None:
        """The KV cache's dtype where ``cache.kv_cache_dtype`` names one other than the
        model's (None: the model's)."""
        name = self.config.cache.kv_cache_dtype
        kv: torch.dtype | None = None if name == "auto" else getattr(torch, name)
        return None if kv == self.dtype else kv

    def _checkpoint_max_len(self) -> int | None:
        for name in ("max_position_embeddings", "n_positions"):
            value = getattr(self.hf_config, name, None)
            if value:
                return int(value)
        return None

    def get_max_model_len(self) -> int:
        return self.config.model.max_model_len or self._checkpoint_max_len() or 2048

    def _max_num_batched_tokens(self) -> int:
        sched = self.config.scheduler
        if sched.max_num_batched_tokens is not None:
            return sched.max_num_batched_tokens
        return 2048 if sched.chunked_prefill else self.get_max_model_len()

    # --- memory and KV cache ----------------------------------------------------------

    def get_kv_cache_block_bytes(self) -> int:
        spec = self._backend().spec
        elem = torch.empty((), dtype=spec.cache_dtype).element_size()
        shape = self._backend().kv_cache_shape(1)
        return int(np.prod(shape)) * elem * spec.num_layers

    @torch.inference_mode()
    def determine_available_memory(self) -> int:
        cache_cfg = self.config.cache
        if self.device.type != "cuda":
            if cache_cfg.kv_cache_bytes is not None:
                return cache_cfg.kv_cache_bytes
            import psutil

            # On CPU the ranks share the host's RAM: each takes its share of the fraction.
            # Nothing is profiled: the fraction does not depend on activation memory.
            share = cache_cfg.cpu_kv_cache_fraction / self.parallel.world_size
            return int(psutil.virtual_memory().available * share)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run()
        if cache_cfg.kv_cache_bytes is not None:
            return cache_cfg.kv_cache_bytes
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        peak = torch.cuda.max_memory_reserved(self.device) + self._backend().workspace_bytes()
        if graphs_apply(self):
            peak += measure_graph_memory(self)
        # Memory used outside this process's torch allocator (other processes, NCCL).
        non_torch = total - free - torch.cuda.memory_reserved(self.device)
        return max(int(total * cache_cfg.gpu_memory_utilization) - peak - non_torch, 0)

    def _profile_run(self) -> None:
        """A forward at the largest batch (no KV cache), then sampling at the largest
        batch, to measure peak activation memory."""
        total = self._max_num_batched_tokens()
        per_req = max(1, min(total, self.get_max_model_len()))
        lens = [per_req] * (total // per_req) + ([total % per_req] if total % per_req else [])
        ids = torch.zeros(total, dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        ctx = AttentionContext(self._backend(), self._backend().build_profile_metadata(lens))
        hidden = self._forward(ids, positions, None, ctx)
        if self.parallel.is_last_pp_rank:
            # Every verified draft position needs its own row of logits.
            spec = self.config.speculative
            per_seq = 1 + (spec.num_speculative_tokens if spec.enabled else 0)
            rows = min(self.config.scheduler.max_num_seqs * per_seq, total)
            logits = self.model.compute_logits(hidden[:rows])
            # The sampler's softmax and sort over the vocabulary at the largest batch.
            logits.float().softmax(dim=-1).sort(dim=-1)
        del hidden

    def initialize_kv_cache(self, num_blocks: int) -> None:
        tensors = self._backend().allocate_kv_cache(num_blocks)
        if len(self.kv_cache_group_windows) > 1:
            tensors = [tensors[slot] for slot in self._layer_slots]  # one entry per layer
        self.kv_caches = tensors
        self.num_blocks = num_blocks
        if graphs_apply(self):
            self.decode_graphs = DecodeGraphs(self, self.kv_caches)
            self.decode_graphs.capture()
            if piecewise_graphs_apply(self):
                seam = CudaGraphSeam(self.device)
                self.piecewise_graphs = PiecewiseGraphs(self, self.kv_caches, seam)
                self.piecewise_graphs.capture()
        elif self.lora is None:  # one foreign call for the step: no point to add a delta
            self.fused_decode = self._backend().fused_decode(self.model, self.kv_caches)
        else:
            note_fused_decode_off(self._backend())
        if self.kv_connector is not None:
            self.kv_connector.bind_caches(self.kv_caches)
        elif self.worker_spec.kv_connector_ref:
            ref = self.worker_spec.kv_connector_ref
            name = self.config.kv_transfer.connector or ref
            connector = build_worker_component(
                "kv_connector",
                lambda: import_ref(ref)().worker_side(self.config, self.parallel.rank),
                {name: ref},
                self.worker_spec,
                name=name,
            )
            self.kv_connector = KVConnectorBridge(connector, self.kv_caches, name)
        if self.lora is not None:
            self.lora.finish_preload()  # --lora-modules, read meanwhile; a bad one fails here

    # --- request state --------------------------------------------------------------

    def _persistent_batch(self) -> PersistentBatch:
        if self.batch is None:
            self.batch = PersistentBatch(self.hf_config.vocab_size, self.device, self.eos_token_ids)
        return self.batch

    def _stage(self, name: str, values: np.ndarray) -> torch.Tensor:
        """``values`` on the device through this input's staging buffer (staging.py):
        pinned host memory and a non-blocking copy, never a copy that waits for the
        device."""
        buf = self._staging.get(name)
        dtype = _TORCH_DTYPES.get(values.dtype)
        if dtype is None:  # (a tensor made only to read its dtype: a rare array type)
            dtype = torch.from_numpy(values[:0]).dtype
        if buf is None or buf.device_buf.shape[0] < len(values) or buf.device_buf.dtype != dtype:
            # Doubling: arrays that grow step by step (penalised outputs) reallocate rarely.
            grown = 2 * buf.device_buf.shape[0] if buf is not None else 0
            size = max(len(values), grown, self._max_num_batched_tokens(), 1)
            # On a CPU the step's arrays are the model's inputs as they are.
            buf = StagingBuffer((size,), dtype, self.device, self.events, stage_on_host=False)
            self._staging[name] = buf
        return buf.fill(values)

    def _update_states(self, so: SchedulerOutput) -> None:
        tables = self.block_tables
        batch = self._persistent_batch()
        gone = (*so.finished_req_ids, *so.preempted_req_ids)
        for req_id in gone:
            self.requests.pop(req_id, None)
            for table in tables:
                table.remove(req_id)
            if self.lora is not None:
                self.lora.remove_request(req_id)
        if gone:
            batch.remove(gone)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            if self.lora is not None:
                self.lora.add_request(new.req_id, new.lora_request)
            gen = None
            if params.seed is not None and not params.greedy:
                gen = self._make_generator(params.seed)
                # A request resumed after preemption continues its random stream.
                vocab = self.hf_config.vocab_size
                for _ in new.output_token_ids:
                    torch.empty(vocab, device=self.device).exponential_(generator=gen)
            if new.group_block_ids is not None and len(tables) > 1:
                for table, ids in zip(tables, new.group_block_ids, strict=True):
                    table.add(new.req_id, ids)
            else:
                self.block_table.add(new.req_id, new.block_ids)
            self.requests[new.req_id] = RequestState(
                req_id=new.req_id,
                prompt_token_ids=list(new.prompt_token_ids),
                sampling_params=params,
                output_token_ids=list(new.output_token_ids),
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                generator=gen,
            )
            batch.add(
                new.req_id,
                new.prompt_token_ids,
                new.output_token_ids,
                params,
                gen,
                num_computed_tokens=new.num_computed_tokens,
            )
            if params.prompt_logprobs is not None and not new.output_token_ids:
                # Not on resumption after preemption: they were sent with the first token.
                if new.num_computed_tokens == 0:
                    self.requests[new.req_id].prompt_logprobs = PromptLogprobsAccumulator(
                        params.prompt_logprobs, len(new.prompt_token_ids)
                    )
                else:  # KV loaded from elsewhere (a connector): those positions have no logits
                    logger.warning(
                        "request %s: no prompt logprobs, its first %d prompt tokens were "
                        "not computed here",
                        new.req_id,
                        new.num_computed_tokens,
                    )
        cached = so.scheduled_cached_reqs
        req_ids = cached.req_ids
        if not req_ids:
            return
        requests = self.requests
        try:
            states = lookup(requests, req_ids)
        except KeyError:
            req_id = next(r for r in req_ids if r not in requests)
            raise EngineCoreError(
                f"scheduler sent cached request {req_id!r} that this model runner does "
                "not hold (it was never added, or was finished/preempted)"
            ) from None
        # With speculation the scheduler counts draft slots optimistically until it sees
        # how many were accepted: this runner's own count is exact.
        if self.drafter is None:
            batch.computed[lookup_ints(batch.row_of, req_ids)] = cached.num_computed_tokens
        # New blocks and tokens, only for the requests that have some (most steps: none).
        # Each list may be shorter than the requests (or empty): zip stops at its end.
        plain_from = 0
        if len(tables) > 1:
            new_group_ids = cached.new_group_block_ids
            plain_from = len(new_group_ids)
            for req_id, by_group in compress(
                zip(req_ids, new_group_ids, strict=False), new_group_ids
            ):
                for table, ids in zip(tables, by_group or (), strict=True):
                    table.append(req_id, ids)
        self.block_table.append_each(req_ids[plain_from:], cached.new_block_ids[plain_from:])
        new_tokens = cached.new_token_ids
        for i in compress(range(len(new_tokens)), new_tokens):
            # Only when this rank does not sample (pipeline parallelism).
            state = states[i]
            state.output_token_ids.extend(new_tokens[i])
            state.token_ids.extend(new_tokens[i])
            batch.append_tokens(batch.row_of[req_ids[i]], new_tokens[i])

    # --- the step -------------------------------------------------------------------

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        output = super().sample_tokens(grammar_output)
        self._free_after_sampling.clear()
        if self.lora is not None:
            output.lora_report = self.lora.take_report()  # adapters read since the last step
        return output

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        so = scheduler_output
        steady, self._steady = self._steady, None
        if (
            steady is not None
            and self.decode_shortcut
            and steady.kv_caches is self.kv_caches
            and steady.follows(so)
        ):
            self._execute_steady(so, steady)
            return None
        self._update_states(so)
        if self.lora is not None:
            if so.lora_removals:
                self.lora.remove(so.lora_removals)  # unloaded: slots and host copies freed
            self.lora.start_loads(so.lora_loads)  # reads run off the step
        bridge = self.kv_connector
        if bridge is not None:
            bridge.begin_step(so)
        if so.total_num_scheduled_tokens == 0 or not so.num_scheduled_tokens:
            kv_out = bridge.end_step(so) if bridge is not None else None
            self._step = StepState([], [], None, kv_connector_output=kv_out)
            return None
        if self.kv_caches is None:
            raise EngineCoreError("KV cache is not initialized (initialize_kv_cache, or wake_up)")

        # Single-token queries first: attention batches them as one decode group.
        scheduled = so.num_scheduled_tokens
        drafts_of: dict[str, list[int]] = {}
        if so.scheduled_spec_decode_tokens:
            scheduled, drafts_of = self._drafts_to_verify(so)
        counts = scheduled.values()
        all_decodes = self.decode_shortcut and sum(counts) == len(counts) and max(counts) == 1
        if all_decodes:  # the steady state: no per-request pass to split the batch
            decodes, prefills = list(scheduled), []
        else:
            decodes = [r for r, n in scheduled.items() if n == 1]
            prefills = [r for r, n in scheduled.items() if n != 1]
        if bridge is not None and so.scheduled_new_reqs:
            # A request's first step may read KV a connector loads during this very
            # forward: keep it out of the decode group (a backend may serve decodes from
            # state it fills before the forward, like the CPU's dense mirror).
            fresh = {new.req_id for new in so.scheduled_new_reqs}
            prefills = [r for r in decodes if r in fresh] + prefills
            decodes = [r for r in decodes if r not in fresh]
            all_decodes = not prefills
        if decodes:
            view = _BatchView(self._persistent_batch(), self.block_table)
            decodes = self._backend().order_decodes(decodes, view)
        order = decodes + prefills
        num_reqs = len(order)

        states = lookup(self.requests, order)
        batch = self._persistent_batch()
        rows = lookup_ints(batch.row_of, order)
        starts = batch.computed[rows]
        if all_decodes:  # one token per request, at its context length
            self.decode_shortcut_steps += 1
            q_lens = np.ones(num_reqs, dtype=np.int64)
            total = num_reqs
            req_of_token = np.arange(num_reqs)
            positions = starts.copy()
        else:
            q_lens = lookup_ints(scheduled, order)
            total = int(q_lens.sum())
            req_of_token = np.repeat(np.arange(num_reqs), q_lens)
            offsets = np.cumsum(q_lens) - q_lens
            positions = np.arange(total) - offsets[req_of_token] + starts[req_of_token]
        block_table = self.block_table.gather(order)
        prompt_lp_rows: list[tuple[RequestState, int, int, int]] = []  # state, row, n, pos
        verify: list[list[int]] | None = [] if self.drafter is not None else None
        if verify is None and not any_set(states, "prompt_logprobs"):
            input_ids, sample_rows, sampled = self._gather_inputs(
                order, rows, starts, q_lens, req_of_token, positions
            )
        else:
            input_ids, sample_rows, sampled = self._walk_inputs(
                states, starts, q_lens, drafts_of, prompt_lp_rows, verify
            )
        batch.computed[rows] = starts + q_lens
        if len(sampled) == num_reqs:
            sample_req_ids, sample_batch_rows = order, rows
        else:
            sample_req_ids = [order[i] for i in sampled.tolist()]
            sample_batch_rows = rows[sampled]

        bs = self.block_size
        slots = block_table[req_of_token, positions // bs] * bs + positions % bs
        batch_view = AttentionBatch(
            req_ids=order,
            query_lens=q_lens,
            context_lens=starts,
            block_table=block_table,
            slot_mapping=slots,
            num_decodes=len(decodes),
        )
        ids_t = self._stage("input_ids", input_ids)
        pos_t = self._stage("positions", positions)
        head = None
        if not prompt_lp_rows:  # prompt logprobs are scored from the hidden states
            head = self._fused_head(batch_view, len(sample_rows) == total, sample_batch_rows)
        logits = tokens = None
        if head == "tokens":  # the head and its argmax in the fused call: no logits
            tokens = self._run_fused_head(ids_t, pos_t, batch_view, head)
        elif head == "logits":
            logits = self._run_fused_head(ids_t, pos_t, batch_view, head)
        else:
            hidden = self._run_forward(ids_t, pos_t, batch_view, order, req_of_token, positions)
            self._on_hidden(hidden, states, q_lens, starts)
        if (
            head is None
            and len(sample_rows)
            and self.parallel.is_last_pp_rank
            and self.samples_tokens
        ):
            if len(sample_rows) == total:
                logits = self.model.compute_logits(hidden)
            else:
                logits = self.model.compute_logits(
                    hidden.index_select(0, self._stage("sample_rows", sample_rows))
                )
        if prompt_lp_rows and self.parallel.is_last_pp_rank:
            self._gather_prompt_logprobs(hidden, prompt_lp_rows)
        kv_out = bridge.end_step(so) if bridge is not None else None
        self._step = StepState(
            order,
            sample_req_ids,
            logits,
            drafts=verify,
            kv_connector_output=kv_out,
            batch_rows=sample_batch_rows,
            tokens=tokens,
        )
        if (
            all_decodes
            and not so.scheduled_new_reqs
            and verify is None
            and not prompt_lp_rows
            and bridge is None
            and self.lora is None
            and len(self.block_tables) == 1
            and self.samples_tokens
        ):
            self._steady = SteadyDecode.after(so, order, rows, batch.row_of, self.kv_caches)
            self._steady.lay_out(self.block_table)
        return None

    def _execute_steady(self, so: SchedulerOutput, steady: SteadyDecode) -> None:
        """``execute_model`` for a step that :meth:`SteadyDecode.follows`: the scheduler's
        counts and new blocks written into the persistent rows, the inputs gathered from
        them by the last step's rows (flat one-dimensional gathers: see steady_decode.py
        for why)."""
        self.steady_decode_steps += 1
        batch = self._persistent_batch()
        table = self.block_table
        cached = so.scheduled_cached_reqs
        counts = cached.num_computed_tokens
        batch.computed[steady.cached_rows] = np.fromiter(counts, np.int64, len(counts))
        steady.append_blocks(table, cached.req_ids, cached.new_block_ids)
        order = steady.order
        starts = batch.computed[steady.rows]
        ordered = self._backend().order_decodes(order, _BatchView(batch, table, (order, starts)))
        if ordered != order:  # the backend's rows were rebuilt
            steady.reorder(ordered, batch.row_of, table)
            order = ordered
            starts = batch.computed[steady.rows]
        rows = steady.rows
        ends = starts + 1
        _check_known(order, starts, ends, batch.num_tokens[rows])
        input_ids = batch.tokens.reshape(-1)[rows * batch.tokens.shape[1] + starts]
        batch.computed[rows] = ends
        n = len(order)
        batch_view = AttentionBatch(
            req_ids=order,
            query_lens=np.ones(n, dtype=np.int64),
            context_lens=starts,
            block_table=steady.block_table,
            slot_mapping=steady.slots(starts, self.block_size),
            num_decodes=n,
        )
        ids_t = self._stage("input_ids", input_ids)
        pos_t = self._stage("positions", starts)
        head = self._fused_head(batch_view, True, rows)
        logits = tokens = None
        if head is not None:  # the head (and the greedy argmax) in the fused call
            out = self._run_fused_head(ids_t, pos_t, batch_view, head)
            tokens, logits = (out, None) if head == "tokens" else (None, out)
        else:
            hidden = self._run_forward(ids_t, pos_t, batch_view, order, steady.every, starts)
            if self.parallel.is_last_pp_rank:
                logits = self.model.compute_logits(hidden)
            # Freed once sampled, where the step gives up the interpreter lock anyway.
            self._free_after_sampling[:] = [hidden]
        self._step = StepState(
            order, order, logits, batch_rows=rows, tokens=tokens, index=steady.index_of
        )
        self._steady = steady

    def _run_fused_head(
        self, ids_t: torch.Tensor, pos_t: torch.Tensor, batch: AttentionBatch, head: str
    ) -> torch.Tensor:
        """The fused decode step with its head (``"tokens"`` or ``"logits"``): like
        :meth:`_run_forward`, it first lets an engine thread in this process do its work."""
        assert self.fused_decode is not None  # _fused_head chose it
        mark_inputs_staged()
        if head == "tokens":
            n = ids_t.shape[0]
            if self._fused_tokens.shape[0] < n:
                self._fused_tokens = np.empty(n, dtype=np.int64)
            into: torch.Tensor = self.fused_decode.run(
                ids_t, pos_t, batch, head=head, tokens_into=self._fused_tokens
            )
            return into
        out: torch.Tensor = self.fused_decode.run(ids_t, pos_t, batch, head=head)
        return out

    def _fused_head(
        self, batch: AttentionBatch, every_row_samples: bool, sample_rows: np.ndarray
    ) -> str | None:
        """What the fused decode step computes beyond the hidden states for this step:
        the greedy tokens (``"tokens"``: every row samples its argmax and needs nothing
        more, the conditions of ``sample_tokens``' greedy shortcut), the logits
        (``"logits"``: every row samples), or nothing (None: the forward path as it is)."""
        fused = self.fused_decode
        if (
            fused is None
            or not getattr(fused, "has_head", False)
            or not every_row_samples
            or not self.samples_tokens
            or self.kv_connector is not None
            or self.decode_graphs is not None
            or not fused.handles(batch)
        ):
            return None
        assert self.batch is not None  # made by this step's _persistent_batch
        if (
            self.greedy_shortcut
            and self.drafter is None
            and self.parallel.world_size == 1
            and self.batch.all_plain_greedy(sample_rows)
        ):
            return "tokens"
        return "logits"

    def _gather_inputs(
        self,
        order: list[str],
        rows: np.ndarray,
        starts: np.ndarray,
        q_lens: np.ndarray,
        req_of_token: np.ndarray,
        positions: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The step's token ids from the persistent rows, in a few vectorised gathers;
        the logits rows to sample and the requests (indices in ``order``) they belong to."""
        batch = self._persistent_batch()
        ends = starts + q_lens
        known = batch.num_tokens[rows]
        _check_known(order, starts, ends, known)
        input_ids = batch.tokens[rows[req_of_token], positions]
        due = ends == known  # prefill complete: a new token is due
        last_rows = np.cumsum(q_lens) - 1
        if due.all():
            return input_ids, last_rows, np.arange(len(order))
        which = np.flatnonzero(due)
        return input_ids, last_rows[which], which

    def _walk_inputs(
        self,
        states: list[RequestState],
        starts: np.ndarray,
        q_lens: np.ndarray,
        drafts_of: dict[str, list[int]],
        prompt_lp_rows: list[tuple[RequestState, int, int, int]],
        verify: list[list[int]] | None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """As :meth:`_gather_inputs`, request by request: drafts to verify, prompt
        logprobs."""
        input_ids: list[int] = []
        sample_rows: list[int] = []
        sampled: list[int] = []
        cu = 0
        for i, state in enumerate(states):
            start, n = int(starts[i]), int(q_lens[i])
            end = start + n
            drafts = drafts_of.get(state.req_id) if drafts_of else None
            if drafts:
                # Verify: the last known token, then the drafts; every position samples.
                if start != len(state.token_ids) - 1:
                    raise EngineCoreError(
                        f"request {state.req_id!r}: drafts scheduled at position {start}, "
                        f"but the model runner knows {len(state.token_ids)} tokens"
                    )
                input_ids.append(state.token_ids[start])
                input_ids.extend(drafts)
                sample_rows.extend(range(cu, cu + n))
                cu += n
                sampled.append(i)
                if verify is None:  # drafts come only from a drafter, which makes verify a list
                    raise EngineCoreError(f"request {state.req_id!r}: drafts without a drafter")
                verify.append(drafts)
                continue
            if end > len(state.token_ids):
                raise EngineCoreError(
                    f"request {state.req_id!r}: scheduled tokens {start}..{end} but only "
                    f"{len(state.token_ids)} are known to the model runner"
                )
            if n == 1:
                input_ids.append(state.token_ids[start])
            else:
                input_ids.extend(state.token_ids[start:end])
            if state.prompt_logprobs is not None:
                rows = state.prompt_logprobs.wants(start, end)
                if rows is not None:
                    prompt_lp_rows.append((state, cu + rows[0], rows[1] - rows[0], start + rows[0]))
            cu += n
            if end == len(state.token_ids):  # prefill complete: a new token is due
                sample_rows.append(cu - 1)
                sampled.append(i)
                if verify is not None:
                    verify.append([])
        return (
            np.asarray(input_ids, dtype=np.int64),
            np.asarray(sample_rows, dtype=np.int64),
            np.asarray(sampled, dtype=np.int64),
        )

    def _run_forward(
        self,
        ids_t: torch.Tensor,
        pos_t: torch.Tensor,
        batch: AttentionBatch,
        order: list[str],
        req_of_token: np.ndarray,
        positions: np.ndarray,
    ) -> torch.Tensor:
        bridge = self.kv_connector
        if self.lora is not None:
            self.lora.set_batch(order, np.asarray(batch.query_lens))
        mark_inputs_staged()  # an engine thread in this process may do its work now
        if self.decode_graphs is not None and self.decode_graphs.handles(batch):
            hidden = self.decode_graphs.run(ids_t, pos_t, batch)
        elif self.fused_decode is not None and bridge is None and self.fused_decode.handles(batch):
            fused: torch.Tensor = self.fused_decode.run(ids_t, pos_t, batch)
            hidden = fused
        elif self.piecewise_graphs is not None and self.piecewise_graphs.handles(batch):
            meta = self._backend().build_metadata(batch)
            hidden = self.piecewise_graphs.run(ids_t, pos_t, meta)
        else:
            meta = self._backend().build_metadata(batch)
            ctx = AttentionContext(self.attn_backend, meta, bridge, batch)
            if len(self.block_tables) > 1:
                ctx.group_metadata = [meta] + [
                    self._backend().build_metadata(
                        self._group_batch(batch, g, order, req_of_token, positions)
                    )
                    for g in range(1, len(self.block_tables))
                ]
            hidden = self._forward(ids_t, pos_t, self.kv_caches, ctx)
        return hidden

    def _on_hidden(
        self,
        hidden: torch.Tensor,
        states: list[RequestState],
        q_lens: np.ndarray,
        starts: np.ndarray,
    ) -> None:
        """Every scheduled token's final hidden state, rows in ``states`` order (each
        request ``q_lens[i]`` rows from position ``starts[i]``). The pooling runner pools
        them; generation needs only the sampled rows."""

    def _group_batch(
        self,
        batch: AttentionBatch,
        group: int,
        order: list[str],
        req_of_token: np.ndarray,
        positions: np.ndarray,
    ) -> AttentionBatch:
        """The step's batch as KV cache group ``group`` sees it: its own block table."""
        table = self.block_tables[group].gather(order)
        bs = self.block_size
        slots = table[req_of_token, positions // bs] * bs + positions % bs
        return dataclasses.replace(
            batch, block_table=table, slot_mapping=slots, kv_cache_group=group
        )

    def _gather_prompt_logprobs(
        self, hidden: torch.Tensor, rows: list[tuple[RequestState, int, int, int]]
    ) -> None:
        """Score each chunk's next prompt tokens (see ``prompt_logprobs.py``); the
        targets go to the device in one staged copy, and nothing is read back."""
        targets = np.concatenate(
            [
                np.asarray(state.prompt_token_ids[pos + 1 : pos + 1 + count], dtype=np.int64)
                for state, _, count, pos in rows
            ]
        )
        targets_t = self._stage("prompt_logprob_targets", targets)
        offset = 0
        for state, row, count, _ in rows:
            logits = self.model.compute_logits(hidden[row : row + count])
            assert state.prompt_logprobs is not None  # rows are of requests that asked
            state.prompt_logprobs.add(logits, targets_t[offset : offset + count])
            offset += count

    def _drafts_to_verify(self, so: SchedulerOutput) -> tuple[dict[str, int], dict[str, list[int]]]:
        """Each request's drafts this step and its query length (1 + drafts).

        Slots the scheduler filled with real ids are verified as given; ``-1``
        placeholders (async scheduling) take the drafts this runner proposed after the
        previous step, up to the number of slots. Unused slots are simply not run.
        """
        if self.drafter is None:
            raise EngineCoreError(
                "the scheduler sent draft tokens, but speculative decoding is off in this "
                "model runner (set speculative_method and num_speculative_tokens)"
            )
        scheduled = dict(so.num_scheduled_tokens)
        drafts_of: dict[str, list[int]] = {}
        for req_id, slots in so.scheduled_spec_decode_tokens.items():
            if not slots or req_id not in scheduled:
                continue
            if min(slots) >= 0:
                drafts = list(slots)
            else:
                drafts = self.requests[req_id].drafts[: len(slots)]
            drafts_of[req_id] = drafts
            scheduled[req_id] += len(drafts) - len(slots)
        return scheduled, drafts_of

    def _forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor] | None,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        """The model's forward on this rank; pipeline stages receive the previous stage's
        hidden states and send theirs on (torch.distributed point-to-point)."""
        par = self.parallel
        if par.pp_size == 1:
            output: torch.Tensor = self.model(ids, positions, kv_caches, ctx)
            return output
        import torch.distributed as dist

        received = None
        if not par.is_first_pp_rank:
            received = torch.empty(
                ids.shape[0], self.model.hidden_size, dtype=self.dtype, device=self.device
            )
            dist.recv(received, src=par.prev_pp_rank)
        hidden: torch.Tensor = self.model(ids, positions, kv_caches, ctx, received)
        if not par.is_last_pp_rank:
            dist.send(hidden.contiguous(), dst=par.next_pp_rank)
        return hidden

    def sleep(self, level: int = 1) -> None:
        """Level 1 frees the KV cache; level 2 also drops the weights (reloaded on wake)."""
        self.kv_caches = None
        self._steady = None
        self.decode_graphs = None
        self.piecewise_graphs = None
        self.fused_decode = None
        if self.attn_backend is not None:
            self.attn_backend.release_kv_cache()
        if level >= 2:
            self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        """Restore what ``sleep`` freed. KV contents are lost: the prefix cache must be reset."""
        if self.model is None:
            self.load_model()
        if self.kv_caches is None and self.num_blocks:
            self.initialize_kv_cache(self.num_blocks)


def _check_known(order: list[str], starts: np.ndarray, ends: np.ndarray, known: np.ndarray) -> None:
    """Refuse a step that schedules tokens the runner does not hold (a scheduler's error)."""
    if (ends > known).any():
        i = int(np.flatnonzero(ends > known)[0])
        raise EngineCoreError(
            f"request {order[i]!r}: scheduled tokens {int(starts[i])}..{int(ends[i])} "
            f"but only {int(known[i])} are known to the model runner"
        )


def linear_method_name(
    config: EngineConfig,
    path: str,
    hf_config: Any,
    device_type: str,
    dtype: torch.dtype,
    refs: dict[str, str],
) -> str:
    """``model.linear_method``; for ``auto``, a GGUF file, an AWQ / GPTQ checkpoint and
    ``model.quantization: int8`` keep their weights quantized through the registered method
    that keeps blocks (names ``gguf_formats``) and serves the device and dtype, the highest
    ``priority`` first (unless ``model.quantization`` is ``none``)."""
    wanted = config.model.linear_method
    quantization = config.model.quantization
    quantized = is_gguf(path) or quantization == "int8" or group_quant_config(hf_config)
    if wanted != "auto" or quantization == "none" or not quantized:
        return wanted
    dtype_name = str(dtype).removeprefix("torch.")
    name, refusals = block_linear_method(refs, device_type, dtype_name)
    if name is not None:
        return name
    if quantization == "int8":
        why = "; ".join(refusals) or "no registered linear method keeps weights in blocks"
        raise ConfigError(
            f"quantization 'int8' runs through a linear method that keeps weights in blocks, "
            f"and none serves {device_type} / {dtype_name} here: {why}"
        )
    return wanted


def block_linear_method(
    refs: dict[str, str], device_type: str, dtype_name: str
) -> tuple[str | None, list[str]]:
    """The registered linear method with the highest ``priority`` that keeps quantized
    weights in blocks and serves ``device_type`` / ``dtype_name`` (None if none does), and
    why each other block-keeping method was passed over."""
    serving: list[tuple[int, str]] = []
    refusals: list[str] = []
    for name, ref in refs.items():
        method_cls: type[LinearMethod] = import_ref(ref)
        if not method_cls.gguf_formats:
            continue
        reason = method_cls.unsupported_reason(device_type, dtype_name)
        if reason is None:
            serving.append((method_cls.priority, name))
        else:
            refusals.append(f"{name!r} {reason}")
    return (max(serving)[1] if serving else None), refusals
