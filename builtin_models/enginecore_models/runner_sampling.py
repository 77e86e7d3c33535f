"""The sampling half of a step: logits in, tokens and logprobs out.

``execute_model`` leaves the step's logits (one row per request whose next token is due,
plus one per draft under speculative decoding); ``sample_tokens`` applies the grammar
bitmask, samples or verifies, shares the tokens across ranks and updates each request's
state. A mixin of :class:`TorchModelRunner`, kept apart so each file reads on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from enginecore.distributed import ParallelContext
from enginecore.errors import PluginContractError
from enginecore.runner_output import KVConnectorOutput, LogprobsLists, ModelRunnerOutput
from enginecore.scheduler_output import GrammarOutput
from enginecore_models.drafter import TokenBuffer
from enginecore_models.per_request import any_set, append_each, lookup, values_of
from enginecore_models.prompt_logprobs import device_rows, split_rows
from enginecore_models.rejection_sampler import SeededStreams, accept, expand_rows
from enginecore_models.sampler import (
    Sampler,
    apply_grammar_bitmask,
    build_sampling_metadata,
    logprobs_lists,
)

if TYPE_CHECKING:
    from enginecore.staging import HostCopy
    from enginecore_models.drafter import Drafter
    from enginecore_models.model_runner import RequestState
    from enginecore_models.persistent_batch import PersistentBatch


# The step's copy, by name (each keeps its own host buffer across steps).
_COPY_NAMES = ("sampled", "logprob_ids", "logprobs", "logprob_ranks")
_PROMPT_COPY_NAMES = ("prompt_logprob_ids", "prompt_logprobs", "prompt_logprob_ranks")


@dataclass
class StepState:
    """What ``execute_model`` leaves for ``sample_tokens``."""

    req_ids: list[str]  # every scheduled request, in batch order
    sample_req_ids: list[str]  # those whose next token is due (prefill complete)
    logits: torch.Tensor | None  # [rows, vocab]: one row per sample request and draft
    # Per sample request: the drafts verified this step (None: no speculative decoding).
    drafts: list[list[int]] | None = None
    kv_connector_output: KVConnectorOutput | None = None
    # The persistent-batch rows of ``sample_req_ids``.
    batch_rows: np.ndarray | None = None
    # Each sample request's greedy token, where the forward computed them (the fused
    # decode step's head and argmax; ``logits`` is then None).
    tokens: torch.Tensor | None = None
    # Each of ``req_ids``' index, where the step kept it (a steady decode's, reused
    # while the requests and their order stay); None: made when sampled.
    index: dict[str, int] | None = None


class SamplingPhase:
    """Needs the runner's ``requests``, ``sampler``, ``drafter``, ``parallel``, ``device``,
    ``eos_token_ids``, ``hf_config`` and the ``_step`` that ``execute_model`` left."""

    requests: dict[str, RequestState]
    hf_config: Any
    sampler: Sampler
    drafter: Drafter | None
    parallel: ParallelContext
    device: torch.device
    eos_token_ids: list[int]
    _step: StepState | None
    greedy_shortcut: bool
    greedy_shortcut_steps: int
    batch: PersistentBatch | None
    host_copy: HostCopy
    _stage: Callable[[str, np.ndarray], torch.Tensor]  # the runner's staged host->device copy

    def _read_back(
        self, wanted: list[torch.Tensor], sample_req_ids: list[str]
    ) -> tuple[list[np.ndarray], dict[str, LogprobsLists] | None]:
        """The step's one device-to-host copy: ``wanted`` (the sampled ids, then the
        logprobs' ids, values and ranks where asked; as arrays, in order) and the prompt
        logprobs of requests whose first token is sampled this step."""
        done = []
        states = lookup(self.requests, sample_req_ids)
        if any_set(states, "prompt_logprobs"):
            for req_id, state in zip(sample_req_ids, states, strict=True):
                acc = state.prompt_logprobs
                if acc is not None and acc.complete:
                    done.append((req_id, acc))
        accumulators = [acc for _, acc in done]
        named = dict(zip(_COPY_NAMES, wanted, strict=False))
        packed = device_rows(accumulators) if done else []
        named.update(zip(_PROMPT_COPY_NAMES, packed, strict=False))
        host = self.host_copy.start(named).wait()
        arrays = [host[name] for name in _COPY_NAMES[: len(wanted)]]
        if not done:
            return arrays, None
        prompt_arrays = [host[name] for name in _PROMPT_COPY_NAMES[: len(packed)]]
        taken = {}
        for (req_id, _), result in zip(done, split_rows(accumulators, prompt_arrays), strict=True):
            taken[req_id] = result
            self.requests[req_id].prompt_logprobs = None
        return arrays, taken

    def _batch_rows(self, step: StepState) -> tuple[PersistentBatch, np.ndarray]:
        """The persistent batch and the rows of ``step``'s sample requests (a step with
        requests to sample has both)."""
        assert self.batch is not None and step.batch_rows is not None
        return self.batch, step.batch_rows

    def _share_sampled(self, tokens: torch.Tensor | None, count: int) -> torch.Tensor:
        """Every rank learns the output rank's sampled tokens (broadcast over the world),
        left on the device for the step's one copy.

        Ranks that sampled the same logits would agree anyway; the broadcast makes it a
        guarantee, and gives earlier pipeline stages the tokens they embed next step.
        """
        import torch.distributed as dist

        buf = torch.empty(count, dtype=torch.int64, device=self.device)
        if tokens is not None:
            buf.copy_(tokens)
        dist.broadcast(buf, src=self.parallel.output_rank)
        return buf

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        """Sample one token for each request whose prefill is complete.

        Output rows follow ``req_ids`` (every scheduled request); a partial prefill chunk
        gets ``[]``. ``logprobs`` (when any request asked) has a row per request too,
        empty with rank -1 for requests that did not ask or sampled nothing. Results are
        read back from the device once, in one copy (``_read_back``).
        """
        step = self._step
        if (
            step is not None
            and step.tokens is not None
            and step.sample_req_ids
            and self.drafter is None
        ):  # plain greedy rows whose argmax the forward took: no sampler to run
            self._step = None
            return self._sample_greedy(step, step.tokens, self._index(step))
        return self._sample_with_torch(grammar_output)

    def _index(self, step: StepState) -> dict[str, int]:
        """Each of the step's requests' output row (a steady decode's is kept across steps)."""
        if step.index is not None:
            return step.index
        return dict(zip(step.req_ids, range(len(step.req_ids)), strict=True))

    @torch.inference_mode()
    def _sample_with_torch(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        """:meth:`sample_tokens` where the sampler, a copy or a check may run torch."""
        step, self._step = self._step, None
        if step is None or not step.req_ids:
            return ModelRunnerOutput(
                kv_connector_output=step.kv_connector_output if step is not None else None
            )
        index = self._index(step)
        if not step.sample_req_ids:
            return ModelRunnerOutput(
                req_ids=step.req_ids,
                req_id_to_index=index,
                sampled_token_ids=[[] for _ in step.req_ids],
                kv_connector_output=step.kv_connector_output,
            )
        if self.drafter is not None:
            return self._sample_speculative(step, grammar_output, index)
        batch, rows = self._batch_rows(step)
        if (
            self.greedy_shortcut
            and step.logits is not None
            and self.parallel.world_size == 1
            and not (grammar_output is not None and grammar_output.structured_output_request_ids)
            and batch.all_plain_greedy(rows)
        ):
            return self._sample_greedy(step, self.sampler.greedy_tokens(step.logits), index)
        meta = None
        logprob_tensors: list[torch.Tensor] = []
        if step.logits is None:  # an earlier pipeline stage: learn the tokens, sample none
            token_t = self._share_sampled(None, len(rows))
        else:
            logits = step.logits
            if grammar_output is not None and grammar_output.structured_output_request_ids:
                self._apply_grammar(logits, step.sample_req_ids, grammar_output)
            rows_t = self._stage("sample_batch_rows", rows)

            def to_device(name: str, values: np.ndarray) -> torch.Tensor:
                return self._stage(f"sampling_{name}", values)

            meta = batch.sampling_metadata(rows, rows_t, to_device)
            out = self.sampler.sample(logits, meta)
            batch.count_sampled(rows_t, rows, out.token_ids)
            token_t = out.token_ids
            if self.parallel.world_size > 1:
                token_t = self._share_sampled(out.token_ids, len(rows))
            if out.logprobs is not None:
                assert out.logprob_ids is not None and out.ranks is not None  # set together
                logprob_tensors = [out.logprob_ids, out.logprobs, out.ranks]
        host, prompt_logprobs = self._read_back([token_t, *logprob_tensors], step.sample_req_ids)
        token_array = host[0]
        tokens = token_array.tolist()
        lp = None
        if logprob_tensors:
            assert meta is not None  # logprobs come from this rank's sampler
            lp = logprobs_lists(host[1].tolist(), host[2].tolist(), host[3].tolist(), meta)
        return ModelRunnerOutput(
            req_ids=step.req_ids,
            req_id_to_index=index,
            sampled_token_ids=self._record_sampled(step, token_array, tokens, index),
            logprobs=self._full_logprobs(lp, step, index),
            prompt_logprobs=prompt_logprobs,
            kv_connector_output=step.kv_connector_output,
        )

    def _sample_greedy(
        self, step: StepState, token_t: torch.Tensor, index: dict[str, int]
    ) -> ModelRunnerOutput:
        """The shortcut for a step whose every sampling row is plain greedy (no penalties,
        bias, bans, seeds, logprobs or prompt logprobs; no grammar, no drafts, one rank):
        the argmax (``token_t``) and, from a device, its one host copy, without sampling
        metadata."""
        self.greedy_shortcut_steps += 1
        if token_t.device.type == "cpu":  # already in host memory: nothing to copy
            token_array = token_t.numpy()
        else:
            token_array = self.host_copy.start({"sampled": token_t}).wait()["sampled"]
        tokens = token_array.tolist()
        return ModelRunnerOutput(
            req_ids=step.req_ids,
            req_id_to_index=index,
            sampled_token_ids=self._record_sampled(step, token_array, tokens, index),
            kv_connector_output=step.kv_connector_output,
        )

    def _record_sampled(
        self, step: StepState, token_array: np.ndarray, tokens: list[int], index: dict[str, int]
    ) -> list[list[int]]:
        """Append one sampled token to each sample request (the persistent batch's rows
        and the request states); the output rows, one per scheduled request."""
        batch, rows = self._batch_rows(step)
        batch.append_sampled(rows, token_array)
        states = lookup(self.requests, step.sample_req_ids)
        append_each(values_of(states, "output_token_ids"), tokens)
        append_each(values_of(states, "token_ids"), tokens)
        if len(tokens) == len(step.req_ids):  # every request sampled, in batch order
            return list(map(list, zip(tokens)))
        sampled: list[list[int]] = [[] for _ in step.req_ids]
        for req_id, token in zip(step.sample_req_ids, tokens, strict=True):
            sampled[index[req_id]] = [token]
        return sampled

    def _sample_speculative(
        self, step: StepState, grammar_output: GrammarOutput | None, index: dict[str, int]
    ) -> ModelRunnerOutput:
        """Verify this step's drafts (rejection_sampler.py), then propose the next ones.
        Targets, logprobs and prompt logprobs come back in the step's one copy."""
        assert self.drafter is not None and step.drafts is not None
        assert self.batch is not None  # made by the first execute_model
        batch = self.batch
        states = [self.requests[r] for r in step.sample_req_ids]
        drafts = step.drafts
        num_rows = len(states) + sum(len(d) for d in drafts)
        logprobs = None
        if step.logits is None:  # an earlier pipeline stage: learn the targets
            shared = self._share_sampled(None, num_rows)
            host, prompt_logprobs = self._read_back([shared], step.sample_req_ids)
            accepted = accept(host[0].tolist(), drafts)
        else:
            logits = step.logits
            owner, outputs = expand_rows(
                [s.sampling_params for s in states], [s.output_token_ids for s in states], drafts
            )
            if grammar_output is not None and grammar_output.structured_output_request_ids:
                # Requests under a grammar have no drafts: name each request's first row.
                first_rows: list[str | None] = [None] * num_rows
                row = 0
                for state, d in zip(states, drafts, strict=True):
                    first_rows[row] = state.req_id
                    row += len(d) + 1
                self._apply_grammar(logits, first_rows, grammar_output)
            generators = [s.generator for s in states]
            streams = SeededStreams(generators, drafts)
            meta = build_sampling_metadata(
                [states[i].sampling_params for i in owner],
                [states[i].prompt_token_ids for i in owner],
                outputs,
                [generators[i] for i in owner],
                self.eos_token_ids,
                logits.shape[-1],
                self.device,
                lambda name, values: self._stage(f"verify_{name}", values),
            )
            out = self.sampler.sample(logits, meta)
            targets_t = out.token_ids
            if self.parallel.world_size > 1:
                targets_t = self._share_sampled(out.token_ids, num_rows)
            logprob_tensors: list[torch.Tensor] = []
            if out.logprobs is not None:
                assert out.logprob_ids is not None and out.ranks is not None  # set together
                logprob_tensors = [out.logprob_ids, out.logprobs, out.ranks]
            host, prompt_logprobs = self._read_back(
                [targets_t, *logprob_tensors], step.sample_req_ids
            )
            accepted = accept(host[0].tolist(), drafts)
            streams.rewind(accepted, drafts, logits.shape[-1])
            if logprob_tensors:
                lp = logprobs_lists(host[1].tolist(), host[2].tolist(), host[3].tolist(), meta)
                logprobs = self._spec_logprobs(lp, step, accepted, index)
        n = len(step.req_ids)
        sampled: list[list[int]] = [[] for _ in range(n)]
        num_drafts = [0] * n
        next_drafts: list[list[int]] = [[] for _ in range(n)]
        draft_errors: dict[str, str] = {}
        for state, d, tokens in zip(states, drafts, accepted, strict=True):
            state.output_token_ids.extend(tokens)
            state.token_ids.extend(tokens)
            batch.append_tokens(batch.row_of[state.req_id], tokens)
            batch.computed[batch.row_of[state.req_id]] -= len(d) + 1 - len(tokens)  # rejected
            i = index[state.req_id]
            sampled[i] = tokens
            num_drafts[i] = len(d)
            if state.sampling_params.structured_output is None:
                if state.token_buffer is None:
                    state.token_buffer = TokenBuffer()
                try:
                    state.drafts = self.drafter.propose(
                        state.token_buffer, state.token_ids, self.hf_config.vocab_size
                    )
                except PluginContractError as exc:  # malformed drafts: this request fails
                    state.drafts = []
                    draft_errors[state.req_id] = str(exc)
                next_drafts[i] = state.drafts
        return ModelRunnerOutput(
            req_ids=step.req_ids,
            req_id_to_index=index,
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            kv_connector_output=step.kv_connector_output,
            draft_token_ids=next_drafts,
            num_draft_tokens=num_drafts,
            request_errors=draft_errors or None,
        )

    @staticmethod
    def _spec_logprobs(
        lp: LogprobsLists, step: StepState, accepted: list[list[int]], index: dict[str, int]
    ) -> LogprobsLists:
        """Sampler rows cover every verified position; keep the accepted ones, grouped by
        request in ``req_ids`` order (``cu_num_generated_tokens`` delimits them)."""
        assert step.drafts is not None
        rows_of: list[range] = [range(0) for _ in step.req_ids]
        row = 0
        for req_id, d, tokens in zip(step.sample_req_ids, step.drafts, accepted, strict=True):
            rows_of[index[req_id]] = range(row, row + len(tokens))
            row += len(d) + 1
        ids: list[list[int]] = []
        vals: list[list[float]] = []
        ranks: list[int] = []
        cu = [0]
        for rows in rows_of:
            for r in rows:
                ids.append(lp.logprob_token_ids[r])
                vals.append(lp.logprobs[r])
                ranks.append(lp.sampled_token_ranks[r])
            cu.append(len(ids))
        return LogprobsLists(
            logprob_token_ids=ids,
            logprobs=vals,
            sampled_token_ranks=ranks,
            cu_num_generated_tokens=cu,
        )

    def _apply_grammar(
        self, logits: torch.Tensor, sample_req_ids: Sequence[str | None], grammar: GrammarOutput
    ) -> None:
        row_of = {r: i for i, r in enumerate(sample_req_ids)}
        mask_rows, logit_rows = [], []
        for j, req_id in enumerate(grammar.structured_output_request_ids):
            if req_id in row_of:  # a partial prefill chunk samples nothing
                mask_rows.append(j)
                logit_rows.append(row_of[req_id])
        if not logit_rows:
            return
        host_bitmask = np.asarray(grammar.grammar_bitmask, dtype=np.int32)
        if len(mask_rows) != len(host_bitmask):  # some rows are partial prefills: drop theirs
            host_bitmask = host_bitmask[mask_rows]
        bitmask = torch.from_numpy(np.ascontiguousarray(host_bitmask)).to(self.device)
        rows = torch.tensor(logit_rows, dtype=torch.int64, device=self.device)
        apply_grammar_bitmask(logits, rows, bitmask)

    @staticmethod
    def _full_logprobs(
        lp: LogprobsLists | None, step: StepState, index: dict[str, int]
    ) -> LogprobsLists | None:
        """Sampler rows cover sampling requests only; give every scheduled request a row."""
        if lp is None:
            return None
        n = len(step.req_ids)
        ids: list[list[int]] = [[] for _ in range(n)]
        vals: list[list[float]] = [[] for _ in range(n)]
        ranks = [-1] * n
        for k, req_id in enumerate(step.sample_req_ids):
            i = index[req_id]
            ids[i], vals[i], ranks[i] = (
                lp.logprob_token_ids[k],
                lp.logprobs[k],
                lp.sampled_token_ranks[k],
            )
        return LogprobsLists(logprob_token_ids=ids, logprobs=vals, sampled_token_ranks=ranks)

    # --- sleep mode -----------------------------------------------------------------
