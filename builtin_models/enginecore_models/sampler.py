"""Batched token sampling over a ``[num_reqs, vocab]`` logits tensor.

Per step the runner builds one :class:`SamplingMetadata` (parameter tensors for the
whole batch); each stage runs only when some request in the batch needs it, so an
all-greedy batch is a single ``argmax``.

Order: logprobs are taken from the raw model logits; then logit_bias, the min_tokens
EOS/stop mask, penalties; greedy rows take the argmax of those; random rows are divided
by their temperature, filtered by min_p, top_k and top_p, and sampled.

Random rows sample by the "exponential race" (``argmax(p / E)`` with ``E ~ Exp(1)``),
which equals sampling from ``p``. Rows with a seed draw ``E`` from their own
``torch.Generator``, so their tokens do not depend on which other requests share the
batch; the other rows draw from one shared generator in a single call.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from enginecore.layers.fused_ops import NO_FUSED_OPS, FusedOps
from enginecore.params import SamplingParams
from enginecore.runner_output import LogprobsLists

_NEG_INF = float("-inf")


@dataclass
class SamplingMetadata:
    """Per-batch sampling parameters as tensors (None: no request in the batch needs it)."""

    all_greedy: bool
    greedy_rows: torch.Tensor | None  # [B] bool, None when all_greedy or none greedy
    temperature: torch.Tensor | None  # [B, 1]; greedy rows hold 1.0
    top_k: torch.Tensor | None  # [B] long, vocab size where off
    top_k_max: int  # the largest top_k, known on the host (0 when off)
    top_p: torch.Tensor | None  # [B, 1]
    min_p: torch.Tensor | None  # [B, 1]
    generators: dict[int, torch.Generator]  # row -> its own generator (seeded requests)
    # Penalties: from output-token counts and prompt-token presence, [B, V].
    presence_penalty: torch.Tensor | None  # [B, 1]
    frequency_penalty: torch.Tensor | None
    repetition_penalty: torch.Tensor | None
    output_counts: torch.Tensor | None  # [B, V] float
    prompt_mask: torch.Tensor | None  # [B, V] bool (only with repetition penalty)
    # logit_bias as scatter coordinates.
    bias_rows: torch.Tensor | None
    bias_cols: torch.Tensor | None
    bias_values: torch.Tensor | None
    # Tokens masked to -inf (EOS/stop ids of rows still below min_tokens).
    ban_rows: torch.Tensor | None
    ban_cols: torch.Tensor | None
    max_num_logprobs: int | None  # None: nobody asked; else the top-k columns computed
    num_logprobs: list[int | None]  # per row
    # vLLM's logprob_token_ids: rows that report listed ids instead of their top-k. The
    # ids, padded with 0, [B, L]; and per row how many it listed (0: a top-k row).
    listed_ids: torch.Tensor | None = None
    num_listed: list[int] | None = None


def _pad(rows: Sequence[Sequence[int]], fill: int) -> np.ndarray:
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), max(width, 1)), fill, dtype=np.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = r
    return out


# Puts a named host array on the device. The runner passes its staging (pinned host
# buffers, non-blocking copies); the default is a plain copy, for callers off the step.
ToDevice = Callable[[str, np.ndarray], torch.Tensor]


def plain_to_device(device: torch.device) -> ToDevice:
    def put(name: str, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values)).to(device)

    return put


def put_2d(to_device: ToDevice, name: str, values: np.ndarray) -> torch.Tensor:
    """A 2-D array through a 1-D staging buffer, viewed back in its shape."""
    return to_device(name, values.reshape(-1)).view(values.shape)


def build_sampling_metadata(
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    generators: Sequence[torch.Generator | None],
    eos_token_ids: Sequence[int],
    vocab_size: int,
    device: torch.device,
    to_device: ToDevice | None = None,
) -> SamplingMetadata:
    """Collect one step's per-request parameters into batch tensors (through
    ``to_device``, by name, where given)."""
    n = len(params)
    put = to_device if to_device is not None else plain_to_device(device)

    def col(name: str, values: list[float]) -> torch.Tensor:
        return put(name, np.asarray(values, dtype=np.float32)).unsqueeze(1)

    greedy = [p.greedy for p in params]
    all_greedy = all(greedy)
    random_params = [p for p in params if not p.greedy]
    temperature = greedy_rows = top_k = top_p = min_p = None
    top_k_max = 0
    if not all_greedy:
        temperature = col(
            "temperature",
            [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
        )
        if any(greedy):
            greedy_rows = put("greedy", np.asarray(greedy, dtype=np.bool_))
        if any(0 < p.top_k < vocab_size for p in random_params):
            ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
            top_k = put("top_k", np.asarray(ks, dtype=np.int64))
            top_k_max = max(ks)
        if any(p.top_p < 1.0 for p in random_params):
            top_p = col("top_p", [p.top_p for p in params])
        if any(p.min_p > 0.0 for p in random_params):
            min_p = col("min_p", [p.min_p for p in params])

    presence = frequency = repetition = counts = prompt_mask = None
    if any(p.needs_penalties for p in params):
        presence = col("presence", [p.presence_penalty for p in params])
        frequency = col("frequency", [p.frequency_penalty for p in params])
        repetition = col("repetition", [p.repetition_penalty for p in params])
        out_ids = put_2d(put, "output_ids", _pad(output_token_ids, vocab_size))
        counts = torch.zeros(n, vocab_size + 1, device=device)
        counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=torch.float32))
        counts = counts[:, :vocab_size]
        if any(p.repetition_penalty != 1.0 for p in params):
            prompt_ids = put_2d(put, "prompt_ids", _pad(prompt_token_ids, vocab_size))
            prompt_mask = torch.zeros(n, vocab_size + 1, dtype=torch.bool, device=device)
            prompt_mask.scatter_(1, prompt_ids, True)
            prompt_mask = prompt_mask[:, :vocab_size]

    bias_rows = bias_cols = bias_values = None
    if any(p.logit_bias for p in params):
        rows, cols, vals = [], [], []
        for i, p in enumerate(params):
            for tok, val in (p.logit_bias or {}).items():
                if 0 <= int(tok) < vocab_size:
                    rows.append(i)
                    cols.append(int(tok))
                    vals.append(float(val))
        bias_rows = put("bias_rows", np.asarray(rows, dtype=np.int64))
        bias_cols = put("bias_cols", np.asarray(cols, dtype=np.int64))
        bias_values = put("bias_values", np.asarray(vals, dtype=np.float32))

    ban_rows = ban_cols = None
    ban_r: list[int] = []
    ban_c: list[int] = []
    for i, p in enumerate(params):
        if p.min_tokens and len(output_token_ids[i]) < p.min_tokens:
            banned = set(p.stop_token_ids or ())
            if not p.ignore_eos:
                banned.update(eos_token_ids)
            for tok in banned:
                if 0 <= tok < vocab_size:
                    ban_r.append(i)
                    ban_c.append(tok)
    if ban_r:
        ban_rows = put("ban_rows", np.asarray(ban_r, dtype=np.int64))
        ban_cols = put("ban_cols", np.asarray(ban_c, dtype=np.int64))

    num_logprobs = [p.logprobs for p in params]
    listed_ids, num_listed = listed_logprob_ids(params, vocab_size, put)
    return SamplingMetadata(
        all_greedy=all_greedy,
        greedy_rows=greedy_rows,
        temperature=temperature,
        top_k=top_k,
        top_k_max=top_k_max,
        top_p=top_p,
        min_p=min_p,
        generators={i: g for i, g in enumerate(generators) if g is not None and not greedy[i]},
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        output_counts=counts,
        prompt_mask=prompt_mask,
        bias_rows=bias_rows,
        bias_cols=bias_cols,
        bias_values=bias_values,
        ban_rows=ban_rows,
        ban_cols=ban_cols,
        max_num_logprobs=top_k_logprobs(num_logprobs, num_listed),
        num_logprobs=num_logprobs,
        listed_ids=listed_ids,
        num_listed=num_listed,
    )


def listed_logprob_ids(
    params: Sequence[SamplingParams], vocab_size: int, to_device: ToDevice
) -> tuple[torch.Tensor | None, list[int] | None]:
    """The rows' ``logprob_token_ids`` as one padded tensor and each row's count (ids the
    logits do not cover are dropped: the frontend refuses them, a direct caller gets no
    row for them rather than an engine fault)."""
    if not any(p.logprob_token_ids for p in params):
        return None, None
    rows = [[t for t in p.logprob_token_ids or () if 0 <= t < vocab_size] for p in params]
    return put_2d(to_device, "listed_ids", _pad(rows, 0)), [len(r) for r in rows]


def top_k_logprobs(
    num_logprobs: Sequence[int | None], num_listed: Sequence[int] | None
) -> int | None:
    """How many top logprobs a step computes: the most a row without listed ids asked for
    (0 when only listed rows asked); None when no row asked for any."""
    if all(k is None for k in num_logprobs):
        return None
    listed = num_listed or [0] * len(num_logprobs)
    wanted = [k for k, n in zip(num_logprobs, listed, strict=True) if k is not None and not n]
    return max(wanted, default=0)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] long
    logprobs: LogprobsLists | None


@dataclass
class DeviceSample:
    """A step's sampled ids and logprob tensors, still on the device (nothing read)."""

    token_ids: torch.Tensor  # [B] long
    # [B, 1 + max logprobs (+ L listed)]: sampled, the top ones, then any listed ids.
    logprob_ids: torch.Tensor | None
    logprobs: torch.Tensor | None
    ranks: torch.Tensor | None  # [B]: the sampled token's rank


class Sampler:
    """Stateless apart from the generator used by unseeded random rows.

    :meth:`sample` reads nothing back from the device (no host sync): its results stay
    on the device until the runner's one copy of the step. Calling the sampler returns
    them read back, as lists (tests and the speculative path)."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator
        # The attention backend's fused kernels (the greedy argmax), set by the runner.
        self.fused_ops: FusedOps = NO_FUSED_OPS
        # Whether reading a value on the host is free (a CPU device: no sync), which
        # lets top-p sort only each row's best candidates. None: by the logits' device.
        self.host_reads_free: bool | None = None

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        out = self.sample(logits, meta)
        logprobs = None
        if out.logprobs is not None:
            assert out.logprob_ids is not None and out.ranks is not None
            logprobs = logprobs_lists(
                out.logprob_ids.tolist(), out.logprobs.tolist(), out.ranks.tolist(), meta
            )
        return SamplerOutput(out.token_ids, logprobs)

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> DeviceSample:
        logits = logits.float()
        raw = logits
        if (
            meta.bias_rows is not None
            or meta.ban_rows is not None
            or meta.output_counts is not None
        ):
            logits = logits.clone()
        if meta.bias_rows is not None and meta.bias_values is not None:  # set together
            logits.index_put_((meta.bias_rows, meta.bias_cols), meta.bias_values, accumulate=True)
        if meta.ban_rows is not None:
            logits[meta.ban_rows, meta.ban_cols] = _NEG_INF
        if meta.output_counts is not None:
            logits = apply_penalties(logits, meta)

        if meta.all_greedy:
            tokens = row_argmax(logits, self.fused_ops)
        else:
            tokens = self._sample_random(logits, meta)
            if meta.greedy_rows is not None:
                tokens = torch.where(meta.greedy_rows, row_argmax(logits, self.fused_ops), tokens)

        if meta.max_num_logprobs is None:
            return DeviceSample(tokens, None, None, None)
        ids, vals, ranks = compute_logprobs(raw, tokens, meta.max_num_logprobs, meta.listed_ids)
        return DeviceSample(tokens, ids, vals, ranks)

    def greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's argmax: what :meth:`sample` gives for rows that are greedy and need
        nothing else (no penalties, bias, bans or logprobs), without building metadata."""
        return row_argmax(logits.float(), self.fused_ops)

    def _sample_random(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        assert meta.temperature is not None  # set whenever a row samples
        logits = logits / meta.temperature
        if meta.top_k is not None or meta.top_p is not None:
            free = self.host_reads_free
            if free is None:
                free = logits.device.type == "cpu"
            logits = apply_top_k_top_p(
                logits, meta.top_k, meta.top_p, meta.top_k_max, candidates=free
            )
        probs = logits.softmax(dim=-1)
        if meta.min_p is not None:
            top = probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < meta.min_p * top, 0.0)
        # Exp(1) noise as -log(U): several times faster on CPU than exponential_().
        noise = torch.rand(probs.shape, generator=self.generator, device=probs.device)
        for row, gen in meta.generators.items():
            noise[row] = torch.rand(probs.shape[-1], generator=gen, device=probs.device)
        noise = noise.log_().neg_().clamp_min_(1e-20)  # clamp: U == 1 would give 0/0
        return row_argmax(probs / noise, self.fused_ops)


def row_argmax(x: torch.Tensor, fused_ops: FusedOps = NO_FUSED_OPS) -> torch.Tensor:
    """Index of each row's maximum (the first one on ties, as ``torch.argmax``), by the
    backend's fused kernel where it has one."""
    out = fused_ops.argmax_rows(x)
    return out if out is not None else x.argmax(dim=-1)


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    counts = meta.output_counts
    # The penalties' tensors come with the counts.
    assert counts is not None
    assert meta.frequency_penalty is not None and meta.presence_penalty is not None
    if meta.repetition_penalty is not None and meta.prompt_mask is not None:
        seen = meta.prompt_mask | (counts > 0)
        penalty = torch.where(seen, meta.repetition_penalty, 1.0)
        # Shrinks both signs toward "less likely": divide positives, multiply negatives.
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = logits - meta.frequency_penalty * counts
    logits = logits - meta.presence_penalty * (counts > 0).float()
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    k_max: int | None = None,
    candidates: bool = True,
) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus to -inf.

    ``k_max`` is the largest top_k when the caller knows it (else it is read from the
    device, a sync). ``candidates`` lets top-p look at each row's best tokens first,
    which needs one read of the device (free on CPU, a sync on a GPU, where the full
    sort is cheap anyway)."""
    if top_k is not None and not k_max:
        k_max = int(top_k.max())
    if top_p is None:
        # Cheaper than a full sort: threshold at each row's k-th largest value.
        assert top_k is not None and k_max is not None
        values = logits.topk(k_max, dim=-1).values
        kth = values.gather(1, (top_k - 1).clamp(max=k_max - 1).unsqueeze(1))
        return logits.masked_fill(logits < kth, _NEG_INF)
    vocab = logits.shape[-1]
    k0 = min(vocab, max(_TOP_P_CANDIDATES, k_max or 0))
    if candidates and k0 < vocab:
        narrowed = _top_p_among_candidates(logits, top_k, top_p, k0)
        if narrowed is not None:
            return narrowed
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), _NEG_INF)
    probs = sorted_logits.softmax(dim=-1)
    # Keep a token if the mass strictly before it is below top_p (the first always stays).
    before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(before >= top_p, _NEG_INF)
    return torch.full_like(logits, _NEG_INF).scatter(1, order, sorted_logits)


_TOP_P_CANDIDATES = 128


def _top_p_among_candidates(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor, k0: int
) -> torch.Tensor | None:
    """Top-k/top-p using only each row's ``k0`` best tokens (a full sort of the vocabulary
    is the slowest step of sampling on CPU). Exact when every row's nucleus ends within
    its candidates; returns None otherwise (a flat distribution), and the caller sorts.
    """
    vals, idx = logits.topk(k0, dim=-1)  # sorted, descending
    full_lse = logits.logsumexp(dim=-1, keepdim=True)
    if top_k is not None:
        ranks = torch.arange(k0, device=logits.device).unsqueeze(0)
        vals = vals.masked_fill(ranks >= top_k.unsqueeze(1), _NEG_INF)
        # Rows whose top-k lies inside the candidates normalise over the top-k only.
        lse = torch.where((top_k <= k0).unsqueeze(1), vals.logsumexp(-1, keepdim=True), full_lse)
    else:
        lse = full_lse
    probs = (vals - lse).exp()
    before = probs.cumsum(dim=-1) - probs
    drop = before >= top_p
    complete = drop[:, -1] | torch.isinf(vals[:, -1])
    if not bool(complete.all()):
        return None
    vals = vals.masked_fill(drop, _NEG_INF)
    return torch.full_like(logits, _NEG_INF).scatter(1, idx, vals)


def compute_logprobs(
    raw_logits: torch.Tensor, tokens: torch.Tensor, k: int, listed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows ``[sampled, top-1..top-k, listed...]`` (ids, logprobs) from the raw model
    logits, and the sampled token's rank; on the device, so that the step's one copy
    carries the listed ids' logprobs too."""
    logprobs = raw_logits.log_softmax(dim=-1)
    sampled = logprobs.gather(1, tokens.unsqueeze(1))
    ranks = (logprobs > sampled).sum(dim=-1) + 1
    id_parts, val_parts = [tokens.unsqueeze(1)], [sampled]
    if k > 0:
        top_vals, top_ids = logprobs.topk(k, dim=-1)
        id_parts.append(top_ids)
        val_parts.append(top_vals)
    if listed is not None:
        id_parts.append(listed)
        val_parts.append(logprobs.gather(1, listed))
    if len(id_parts) == 1:
        return id_parts[0], val_parts[0], ranks
    return torch.cat(id_parts, dim=1), torch.cat(val_parts, dim=1), ranks


def logprobs_lists(
    ids_l: list[list[int]], vals_l: list[list[float]], ranks_l: list[int], meta: SamplingMetadata
) -> LogprobsLists:
    """The read-back rows of :func:`compute_logprobs`, each cut to what its request asked
    for (the sampled token, then its top ones or its listed ids); rows of requests that
    asked for none are empty lists with rank -1."""
    out_ids: list[list[int]] = []
    out_vals: list[list[float]] = []
    out_ranks: list[int] = []
    listed_from = 1 + (meta.max_num_logprobs or 0)
    for i, n in enumerate(meta.num_logprobs):
        num_listed = meta.num_listed[i] if meta.num_listed else 0
        if n is None:
            out_ids.append([])
            out_vals.append([])
            out_ranks.append(-1)
            continue
        if num_listed:
            cols = [0, *range(listed_from, listed_from + num_listed)]
            out_ids.append([ids_l[i][c] for c in cols])
            out_vals.append([vals_l[i][c] for c in cols])
        else:
            out_ids.append(ids_l[i][: n + 1])
            out_vals.append(vals_l[i][: n + 1])
        out_ranks.append(ranks_l[i])
    return LogprobsLists(
        logprob_token_ids=out_ids, logprobs=out_vals, sampled_token_ranks=out_ranks
    )


def apply_grammar_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Mask (in place) tokens a grammar forbids.

    ``bitmask`` is int32 ``[len(rows), ceil(vocab / 32)]``: bit ``j`` of word ``w`` allows
    token ``32 * w + j``. Tokens past the bitmask's width (padding of the model's
    vocabulary) are forbidden.
    """
    if (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.is_contiguous()
        and sys.byteorder == "little"
    ):
        _apply_grammar_bitmask_numpy(logits.numpy(), rows.cpu().numpy(), bitmask.cpu().numpy())
        return
    n, words = bitmask.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().view(n, words * 32)
    vocab = logits.shape[-1]
    if allowed.shape[1] >= vocab:
        allowed = allowed[:, :vocab]
    else:
        pad = torch.zeros(n, vocab - allowed.shape[1], dtype=torch.bool, device=bitmask.device)
        allowed = torch.cat([allowed, pad], dim=1)
    logits[rows] = logits[rows].masked_fill(~allowed, _NEG_INF)


def _apply_grammar_bitmask_numpy(logits: np.ndarray, rows: np.ndarray, bitmask: np.ndarray) -> None:
    """The CPU path: numpy unpacks the inverted bits and masks in two C passes, several
    times cheaper than torch's shift, compare and ``masked_fill`` over every token."""
    packed = np.ascontiguousarray(bitmask, dtype=np.int32).view(np.uint8)
    forbidden = np.unpackbits(~packed, axis=1, bitorder="little").view(bool)
    vocab = logits.shape[1]
    if forbidden.shape[1] >= vocab:
        forbidden = forbidden[:, :vocab]
    else:
        forbidden = np.pad(
            forbidden, ((0, 0), (0, vocab - forbidden.shape[1])), constant_values=True
        )
    if len(rows) == logits.shape[0] and (rows == np.arange(len(rows))).all():
        np.putmask(logits, forbidden, -np.inf)  # every row constrained, in order
    else:
        masked = logits[rows]
        np.putmask(masked, forbidden, -np.inf)
        logits[rows] = masked
