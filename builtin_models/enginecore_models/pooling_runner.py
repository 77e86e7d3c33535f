"""The pooling model runner (``runner = "pooling"``): embeddings instead of tokens.

Every request carries :class:`~enginecore.pooling.PoolingParams` and asks for one
placeholder token; the step that completes its prompt finishes it with the pooled vector
(``ModelRunnerOutput.pooler_output``). The scheduler batches these requests like any
other.

- Decoder embedders (a Qwen3 / Llama checkpoint, with or without its LM head) run the
  generation model over the paged KV cache; each chunk's hidden states are folded into
  the request's running pool (first token, sum, last token), so chunked prefill works.
- Encoders (``BertModel``) attend in both directions and keep no KV cache: the runner
  runs them once a prompt is complete, over a padded batch. Their KV "blocks" only count
  tokens for the scheduler and take no memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from enginecore.errors import ConfigError, EngineCoreError
from enginecore.pooling import PoolerConfig, PoolingParams, read_pooler_config
from enginecore.registry import import_ref
from enginecore.runner_output import ModelRunnerOutput
from enginecore.scheduler_output import GrammarOutput, SchedulerOutput
from enginecore_models.model_runner import RequestState, TorchModelRunner
from enginecore_models.runner_sampling import StepState
from enginecore_models.weight_loader import iter_weights

# Placeholder token each pooling request "samples" so the scheduler finishes it.
_PLACEHOLDER_TOKEN = 0


@dataclass
class _Pool:
    """A request's pool so far, over the prompt chunks computed."""

    first: torch.Tensor | None = None
    total: torch.Tensor | None = None
    count: int = 0
    last: torch.Tensor | None = None


def finish_pool(
    hidden: torch.Tensor, config: PoolerConfig, params: PoolingParams | None
) -> list[float]:
    """Truncate (Matryoshka ``dimensions``), then normalize as the request or checkpoint
    says; float32 on the wire."""
    vector = hidden.float()
    if params is not None and params.dimensions is not None:
        vector = vector[: params.dimensions]
    normalize = config.normalize if params is None or params.normalize is None else params.normalize
    if normalize:
        vector = F.normalize(vector, p=2, dim=-1)
    values: list[float] = vector.tolist()
    return values


class PoolingModelRunner(TorchModelRunner):
    samples_tokens = False

    pooler_config: PoolerConfig
    encoder = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pools: dict[str, _Pool] = {}  # decoders: requests part-way through their prompt
        self._pooled: dict[str, list[float]] = {}  # this step's vectors, for sample_tokens

    # --- loading --------------------------------------------------------------------

    def _model_class(self) -> type[torch.nn.Module]:
        """``XModel`` (a checkpoint saved without its LM head, as sentence-transformers
        saves decoders) is served by the registered ``XForCausalLM``."""
        refs = self.worker_spec.model_refs
        archs = list(getattr(self.hf_config, "architectures", None) or [])
        for arch in archs:
            if arch in refs:
                break
            causal = arch.removesuffix("Model") + "ForCausalLM"
            if arch.endswith("Model") and causal in refs:
                model_cls: type[torch.nn.Module] = import_ref(refs[causal])
                return model_cls
        return super()._model_class()

    def _load_weights(self, model: Any, path: str, keep: tuple[str, ...]) -> None:
        self.encoder = bool(getattr(model, "is_encoder", False))
        if self.parallel.pp_size > 1:
            raise ConfigError("the pooling runner does not run pipeline parallelism")
        self.pooler_config = read_pooler_config(path, self.hf_config)
        weights = iter_weights(path, self.hf_config, keep)
        if not self.encoder:
            # Pooling needs no LM head: drop it, and name a head-less checkpoint's
            # tensors (``layers.0...``, as a saved ``Qwen3Model`` spells them) as the
            # causal model does (``model.layers.0...``).
            model.lm_head = None
            model.tie_word_embeddings = True
            weights = (
                (name if name.startswith(("model.", "lm_head.")) else f"model.{name}", t)
                for name, t in weights
            )
        model.load_weights(weights)

    def _set_attention_backend(self) -> None:
        if not self.encoder:
            super()._set_attention_backend()

    def get_kv_cache_groups(self, allow_hybrid: bool = True) -> list[int | None] | None:
        return None if self.encoder else super().get_kv_cache_groups(allow_hybrid)

    # --- the (absent) KV cache of an encoder ------------------------------------------

    def get_kv_cache_block_bytes(self) -> int:
        return 1 if self.encoder else super().get_kv_cache_block_bytes()

    def determine_available_memory(self) -> int:
        if not self.encoder:
            return super().determine_available_memory()
        # Enough token slots for a full batch of the longest prompts; no memory behind them.
        per_seq = -(-self.get_max_model_len() // self.block_size) + 1
        return per_seq * self.config.scheduler.max_num_seqs + 1

    def initialize_kv_cache(self, num_blocks: int) -> None:
        if self.encoder:
            self.num_blocks = num_blocks
            self.kv_caches = []
            return
        super().initialize_kv_cache(num_blocks)

    def _profile_run(self) -> None:
        if not self.encoder:
            super()._profile_run()

    # --- the step -------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        self._pooled = {}
        if not self.encoder:
            return super().execute_model(scheduler_output)
        so = scheduler_output
        self._update_states(so)
        order = list(so.num_scheduled_tokens)
        done: list[RequestState] = []
        batch = self._persistent_batch()
        for req_id in order:
            state = self.requests[req_id]
            row = batch.row_of[req_id]
            batch.computed[row] += so.num_scheduled_tokens[req_id]
            if batch.computed[row] >= len(state.prompt_token_ids):
                done.append(state)
        if done:
            self._encode(done)
        self._step = StepState(order, [s.req_id for s in done], None)
        return None

    def _encode(self, states: list[RequestState]) -> None:
        """One padded forward over the prompts completed this step, then pool."""
        lengths = [len(s.prompt_token_ids) for s in states]
        ids = torch.zeros(len(states), max(lengths), dtype=torch.int64)
        for row, state in enumerate(states):
            ids[row, : lengths[row]] = torch.tensor(state.prompt_token_ids)
        lens = torch.tensor(lengths, device=self.device)
        hidden = self.model(ids.to(self.device), lens)
        for row, (state, n) in enumerate(zip(states, lengths, strict=True)):
            rows = hidden[row, :n]
            kind = self.pooler_config.pooling_type
            pooled = rows[0] if kind == "cls" else rows[-1] if kind == "last" else rows.mean(0)
            self._pooled[state.req_id] = finish_pool(
                pooled, self.pooler_config, state.sampling_params.pooling
            )

    def _on_hidden(
        self,
        hidden: torch.Tensor,
        states: list[RequestState],
        q_lens: np.ndarray,
        starts: np.ndarray,
    ) -> None:
        pools = self._pools
        kind = self.pooler_config.pooling_type
        row = 0
        for state, n, start in zip(states, q_lens.tolist(), starts.tolist(), strict=True):
            chunk = hidden[row : row + n]
            row += n
            pool = pools.setdefault(state.req_id, _Pool())
            if start == 0:
                pool.first, pool.total, pool.count = chunk[0].float(), None, 0
            if kind == "mean":
                part = chunk.float().sum(0)
                pool.total = part if pool.total is None else pool.total + part
                pool.count += n
            pool.last = chunk[-1].float()
            if start + n < len(state.prompt_token_ids):
                continue
            del pools[state.req_id]
            if kind == "cls":
                if pool.first is None:
                    raise EngineCoreError(f"request {state.req_id!r}: its first token was not run")
                pooled = pool.first
            elif kind == "mean":
                assert pool.total is not None
                pooled = pool.total / pool.count
            else:
                pooled = pool.last
            self._pooled[state.req_id] = finish_pool(
                pooled, self.pooler_config, state.sampling_params.pooling
            )

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in (*so.finished_req_ids, *so.preempted_req_ids):
            self._pools.pop(req_id, None)
        super()._update_states(so)

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        """No sampling: each request whose prompt completed gets its placeholder token
        and its vector."""
        step, self._step = self._step, None
        pooled, self._pooled = self._pooled, {}
        if step is None or not step.req_ids:
            return ModelRunnerOutput(
                kv_connector_output=step.kv_connector_output if step is not None else None
            )
        index = {r: i for i, r in enumerate(step.req_ids)}
        sampled: list[list[int]] = [[] for _ in step.req_ids]
        for req_id in step.sample_req_ids:
            state = self.requests[req_id]
            state.output_token_ids.append(_PLACEHOLDER_TOKEN)
            state.token_ids.append(_PLACEHOLDER_TOKEN)
            sampled[index[req_id]] = [_PLACEHOLDER_TOKEN]
        return ModelRunnerOutput(
            req_ids=step.req_ids,
            req_id_to_index=index,
            sampled_token_ids=sampled,
            kv_connector_output=step.kv_connector_output,
            pooler_output=pooled or None,
        )
