"""The running requests as rows that live across steps.

Each request holds one row from the step that adds it until it finishes or is
preempted: its tokens (prompt, then every sampled token), how many of them are in the KV
cache (``computed``), and its sampling parameters as columns of arrays. The scheduler's
diff updates the rows (new requests added, finished ones removed and the rows condensed
so that they stay ``0..n-1``, sampled tokens appended), so a step gathers its inputs and
its sampling parameters with a few vectorised index operations instead of rebuilding
them from Python lists.

Penalties need each row's output-token counts: they are kept on the device, a
``[rows, vocab]`` tensor allocated when the first penalised request arrives, set when
a request is added and advanced by a scatter of each step's sampled tokens (no host
read, no per-step rebuild).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from enginecore.params import SamplingParams
from enginecore_models.sampler import SamplingMetadata, listed_logprob_ids, top_k_logprobs

# Per-row parameter columns: (name, dtype, value when unused).
_COLUMNS: tuple[tuple[str, Any, float], ...] = (
    ("temperature", np.float32, 1.0),
    ("top_k", np.int64, 0),
    ("top_p", np.float32, 1.0),
    ("min_p", np.float32, 0.0),
    ("presence", np.float32, 0.0),
    ("frequency", np.float32, 0.0),
    ("repetition", np.float32, 1.0),
)


class PersistentBatch:
    def __init__(self, vocab_size: int, device: torch.device, eos_token_ids: Sequence[int]):
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids = list(eos_token_ids)
        self.req_ids: list[str] = []
        self.row_of: dict[str, int] = {}
        self.params: list[SamplingParams] = []
        self.generators: list[torch.Generator | None] = []
        rows = 64
        self.tokens = np.zeros((rows, 256), dtype=np.int64)
        self.num_tokens = np.zeros(rows, dtype=np.int64)
        # Tokens in the KV cache (the scheduler's count, advanced by each step's queries).
        self.computed = np.zeros(rows, dtype=np.int64)
        self.output_lens = np.zeros(rows, dtype=np.int64)  # tokens sampled so far
        self.greedy = np.ones(rows, dtype=bool)
        self.penalised = np.zeros(rows, dtype=bool)
        # Rows needing per-request work when sampled: logit_bias, min_tokens, a seed,
        # logprobs.
        self.special = np.zeros(rows, dtype=bool)
        # Rows whose token is the logits' argmax and nothing else: greedy, no penalties,
        # nothing special, no prompt logprobs, no grammar (``sample_tokens``' greedy shortcut,
        # the fused decode step's argmax).
        self.plain_greedy = np.ones(rows, dtype=bool)
        self.cols = {name: np.full(rows, fill, dtype=dtype) for name, dtype, fill in _COLUMNS}
        self.counts: torch.Tensor | None = None  # [rows, vocab] float, on the device
        self.prompt_mask: torch.Tensor | None = None  # [rows, vocab] bool

    def __len__(self) -> int:
        return len(self.req_ids)

    # --- the scheduler's diff -----------------------------------------------------------

    def _grow(self, rows: int, cols: int) -> None:
        old_rows, old_cols = self.tokens.shape
        new_rows = max(rows, 2 * old_rows) if rows > old_rows else old_rows
        new_cols = max(cols, 2 * old_cols) if cols > old_cols else old_cols
        if (new_rows, new_cols) != (old_rows, old_cols):
            tokens = np.zeros((new_rows, new_cols), dtype=np.int64)
            tokens[:old_rows, :old_cols] = self.tokens
            self.tokens = tokens
        if new_rows > old_rows:

            def widen(a: np.ndarray, fill: Any) -> np.ndarray:
                out = np.full(new_rows, fill, dtype=a.dtype)
                out[:old_rows] = a
                return out

            self.num_tokens = widen(self.num_tokens, 0)
            self.computed = widen(self.computed, 0)
            self.output_lens = widen(self.output_lens, 0)
            self.greedy = widen(self.greedy, True)
            self.penalised = widen(self.penalised, False)
            self.special = widen(self.special, False)
            self.plain_greedy = widen(self.plain_greedy, True)
            for name, _, fill in _COLUMNS:
                self.cols[name] = widen(self.cols[name], fill)
            for attr in ("counts", "prompt_mask"):
                old = getattr(self, attr)
                if old is not None:
                    new = torch.zeros((new_rows, old.shape[1]), dtype=old.dtype, device=old.device)
                    new[:old_rows] = old
                    setattr(self, attr, new)

    def add(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        params: SamplingParams,
        generator: torch.Generator | None,
        num_computed_tokens: int = 0,
    ) -> None:
        if req_id in self.row_of:
            self.remove([req_id])
        row = len(self.req_ids)
        n = len(prompt_token_ids) + len(output_token_ids)
        self._grow(row + 1, n + 1)
        self.req_ids.append(req_id)
        self.row_of[req_id] = row
        self.params.append(params)
        self.generators.append(generator)
        self.output_lens[row] = len(output_token_ids)
        self.tokens[row, : len(prompt_token_ids)] = prompt_token_ids
        self.tokens[row, len(prompt_token_ids) : n] = output_token_ids
        self.num_tokens[row] = n
        self.computed[row] = num_computed_tokens
        self.greedy[row] = params.greedy
        self.special[row] = bool(
            params.logit_bias
            or params.min_tokens
            or params.logprobs is not None
            or params.logprob_token_ids
            or (generator is not None and not params.greedy)
        )
        cols = self.cols
        vocab = self.vocab_size
        cols["temperature"][row] = 1.0 if params.greedy else params.temperature
        cols["top_k"][row] = params.top_k if 0 < params.top_k < vocab else vocab
        cols["top_p"][row] = params.top_p
        cols["min_p"][row] = params.min_p
        cols["presence"][row] = params.presence_penalty
        cols["frequency"][row] = params.frequency_penalty
        cols["repetition"][row] = params.repetition_penalty
        self.penalised[row] = params.needs_penalties
        self.plain_greedy[row] = bool(
            params.greedy
            and not params.needs_penalties
            and not self.special[row]
            and params.prompt_logprobs is None
            and params.structured_output is None
        )
        if params.needs_penalties:
            self._set_penalty_rows(row, prompt_token_ids, output_token_ids)

    def _set_penalty_rows(
        self, row: int, prompt_ids: Sequence[int], output_ids: Sequence[int]
    ) -> None:
        rows, vocab, dev = self.tokens.shape[0], self.vocab_size, self.device
        if self.counts is None:
            self.counts = torch.zeros((rows, vocab), dtype=torch.float32, device=dev)
            self.prompt_mask = torch.zeros((rows, vocab), dtype=torch.bool, device=dev)
        assert self.prompt_mask is not None
        out = torch.tensor([t for t in output_ids if 0 <= t < vocab], dtype=torch.int64)
        self.counts[row] = torch.bincount(out, minlength=vocab)[:vocab].to(dev)
        self.prompt_mask[row] = False
        prompt = torch.tensor([t for t in prompt_ids if 0 <= t < vocab], dtype=torch.int64)
        self.prompt_mask[row, prompt.to(dev)] = True

    def remove(self, req_ids: Sequence[str]) -> None:
        """Drop finished or preempted requests and condense: the last rows move into the
        holes, so the rows stay ``0..n-1``."""
        holes = sorted((self.row_of.pop(r) for r in req_ids if r in self.row_of), reverse=True)
        for hole in holes:
            last = len(self.req_ids) - 1
            if hole != last:
                self._move(last, hole)
            self.req_ids.pop()
            self.params.pop()
            self.generators.pop()

    def _move(self, src: int, dst: int) -> None:
        req_id = self.req_ids[src]
        self.req_ids[dst] = req_id
        self.row_of[req_id] = dst
        self.params[dst] = self.params[src]
        self.generators[dst] = self.generators[src]
        n = int(self.num_tokens[src])
        self.tokens[dst, :n] = self.tokens[src, :n]
        moved = (
            self.num_tokens,
            self.computed,
            self.output_lens,
            self.greedy,
            self.penalised,
            self.special,
        )
        for arr in (*moved, self.plain_greedy):
            arr[dst] = arr[src]
        for arr in self.cols.values():
            arr[dst] = arr[src]
        if self.counts is not None and self.prompt_mask is not None and self.penalised[src]:
            self.counts[dst] = self.counts[src]
            self.prompt_mask[dst] = self.prompt_mask[src]

    def append_tokens(self, row: int, token_ids: Sequence[int]) -> None:
        start = int(self.num_tokens[row])
        end = start + len(token_ids)
        if end > self.tokens.shape[1]:
            self._grow(0, end)
        self.tokens[row, start:end] = token_ids
        self.num_tokens[row] = end
        self.output_lens[row] += len(token_ids)

    def append_sampled(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """One sampled token for each of ``rows`` (the host's copy of the step's ids)."""
        ends = self.num_tokens[rows]
        if len(ends) and int(ends.max()) >= self.tokens.shape[1]:
            self._grow(0, int(ends.max()) + 1)
        self.tokens[rows, ends] = tokens
        self.num_tokens[rows] = ends + 1
        self.output_lens[rows] += 1  # rows are distinct: one token each

    def all_plain_greedy(self, rows: np.ndarray) -> bool:
        """Whether each of ``rows`` samples its logits' argmax and needs nothing more."""
        return bool(self.plain_greedy[rows].all())

    def count_sampled(self, rows: torch.Tensor, rows_np: np.ndarray, tokens: torch.Tensor) -> None:
        """Advance the penalised rows' output counts by this step's tokens, on the device."""
        if self.counts is None or not self.penalised[rows_np].any():
            return
        ones = torch.ones(tokens.shape[0], dtype=self.counts.dtype, device=self.counts.device)
        self.counts.index_put_((rows, tokens), ones, accumulate=True)

    # --- a step -------------------------------------------------------------------------

    def sampling_metadata(
        self,
        rows: np.ndarray,
        rows_t: torch.Tensor,
        to_device: Callable[[str, np.ndarray], torch.Tensor],
    ) -> SamplingMetadata:
        """The parameters of ``rows`` (this step's sampling rows, in logits order).

        ``to_device(name, array)`` stages a host array onto the device through the
        runner's staging buffer of that name (pinned, never a blocking copy)."""
        vocab = self.vocab_size
        greedy = self.greedy[rows]
        all_greedy = bool(greedy.all())
        cols = self.cols

        def col(name: str) -> torch.Tensor:
            return to_device(name, cols[name][rows]).unsqueeze(1)

        temperature = greedy_rows = top_k = top_p = min_p = None
        top_k_max = 0
        if not all_greedy:
            temperature = col("temperature")
            if greedy.any():
                greedy_rows = to_device("greedy", greedy)
            random = ~greedy
            ks = cols["top_k"][rows]
            if (ks[random] < vocab).any():
                top_k = to_device("top_k", ks)
                top_k_max = int(ks.max())
            if (cols["top_p"][rows][random] < 1.0).any():
                top_p = col("top_p")
            if (cols["min_p"][rows][random] > 0.0).any():
                min_p = col("min_p")
        presence = frequency = repetition = counts = prompt_mask = None
        if self.penalised[rows].any():
            assert self.counts is not None and self.prompt_mask is not None
            presence, frequency = col("presence"), col("frequency")
            repetition = col("repetition")
            counts = self.counts.index_select(0, rows_t)
            if (cols["repetition"][rows] != 1.0).any():
                prompt_mask = self.prompt_mask.index_select(0, rows_t)
        meta = SamplingMetadata(
            all_greedy=all_greedy,
            greedy_rows=greedy_rows,
            temperature=temperature,
            top_k=top_k,
            top_k_max=top_k_max,
            top_p=top_p,
            min_p=min_p,
            generators={},
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            output_counts=counts,
            prompt_mask=prompt_mask,
            bias_rows=None,
            bias_cols=None,
            bias_values=None,
            ban_rows=None,
            ban_cols=None,
            max_num_logprobs=None,
            num_logprobs=[],
        )
        special = self.special[rows]
        if special.any():
            self._special_rows(meta, rows, np.flatnonzero(special).tolist(), to_device)
        return meta

    def _special_rows(
        self,
        meta: SamplingMetadata,
        rows: np.ndarray,
        which: list[int],
        to_device: Callable[[str, np.ndarray], torch.Tensor],
    ) -> None:
        """logit_bias, min_tokens bans, seeded generators and logprobs: per request, only
        for the rows that have one."""
        vocab = self.vocab_size
        bias: tuple[list[int], list[int], list[float]] = ([], [], [])
        ban: tuple[list[int], list[int]] = ([], [])
        num_logprobs: list[int | None] = [None] * len(rows)
        for i in which:
            row = int(rows[i])
            p = self.params[row]
            for tok, val in (p.logit_bias or {}).items():
                if 0 <= int(tok) < vocab:
                    bias[0].append(i)
                    bias[1].append(int(tok))
                    bias[2].append(float(val))
            if p.min_tokens and self.output_lens[row] < p.min_tokens:
                banned = set(p.stop_token_ids or ())
                if not p.ignore_eos:
                    banned.update(self.eos_token_ids)
                for tok in banned:
                    if 0 <= tok < vocab:
                        ban[0].append(i)
                        ban[1].append(tok)
            gen = self.generators[row]
            if gen is not None and not p.greedy:
                meta.generators[i] = gen
            num_logprobs[i] = p.logprobs
        if bias[0]:
            meta.bias_rows = to_device("bias_rows", np.asarray(bias[0], dtype=np.int64))
            meta.bias_cols = to_device("bias_cols", np.asarray(bias[1], dtype=np.int64))
            meta.bias_values = to_device("bias_values", np.asarray(bias[2], dtype=np.float32))
        if ban[0]:
            meta.ban_rows = to_device("ban_rows", np.asarray(ban[0], dtype=np.int64))
            meta.ban_cols = to_device("ban_cols", np.asarray(ban[1], dtype=np.int64))
        if any(k is not None for k in num_logprobs):
            if any(self.params[int(rows[i])].logprob_token_ids for i in which):
                params = [self.params[int(row)] for row in rows]
                meta.listed_ids, meta.num_listed = listed_logprob_ids(params, vocab, to_device)
            meta.max_num_logprobs = top_k_logprobs(num_logprobs, meta.num_listed)
            meta.num_logprobs = num_logprobs
