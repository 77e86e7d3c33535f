"""EchoForCausalLM: the next token is a deterministic function of the whole context.

Reply rule: let S be the tokens between the context's last two pad tokens. If the context
after the second pad ends with the first k tokens of S (longest such k), the next token
is S[k] (EOS once all of S is written); with no such k it is S[0]. So after any chat
template's generation prompt the model writes S, then EOS.

The context is read back from the engine's paged KV cache: each position's token id is
stored in its K slot (one attention layer, one KV head of size 1, written by whichever
attention backend runs), so the model sees exactly what the engine's block tables,
prefix cache and chunked prefill give it. It imports only ``enginecore``.

``ECHO_MODEL_STEP_DELAY_S`` (seconds, default 0) makes every forward that long, so a
streaming test sees one token per step even when its client reads slower than the echo
model writes (the frontend merges the deltas a slow reader has not taken yet).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from enginecore.layers import Attention, AttentionContext


class EchoForCausalLM(nn.Module):
    def __init__(self, hf_config: Any, parallel: Any = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.vocab_size = hf_config.vocab_size
        self.pad_id = hf_config.pad_token_id
        eos = hf_config.eos_token_id
        self.eos_id = eos if isinstance(eos, int) else eos[0]
        self.logit = nn.Parameter(torch.ones(1, dtype=dtype))  # the chosen token's logit
        self.hidden_size = self.vocab_size
        self.attn = Attention(num_heads=1, head_dim=1, scale=1.0)  # declares the cache
        self.step_delay_s = float(os.environ.get("ECHO_MODEL_STEP_DELAY_S", "0"))

    def next_token(self, context: list[int]) -> int:
        pads = [i for i, t in enumerate(context) if t == self.pad_id]
        if len(pads) < 2:
            return self.eos_id
        span = context[pads[-2] + 1 : pads[-1]]
        tail = context[pads[-1] + 1 :]
        for k in range(min(len(span), len(tail)), 0, -1):
            if tail[-k:] == span[:k]:
                return span[k] if k < len(span) else self.eos_id
        return span[0] if span else self.eos_id

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor] | None,
        attn_context: AttentionContext,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out = torch.zeros(len(input_ids), self.vocab_size, dtype=self.logit.dtype)
        if kv_caches is None:  # the memory-profiling pass
            return out.to(input_ids.device)
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        cache = kv_caches[0]
        ids = input_ids.to(cache.dtype).view(-1, 1, 1)
        self.attn(ids, ids, ids, cache, attn_context)  # writes each token id as its K
        stored = cache[0].reshape(-1).tolist()  # token id per cache slot
        batch = attn_context.batch
        block_size = cache.shape[2]
        starts = batch.query_start_loc.tolist()
        context_lens = batch.context_lens.tolist()
        for r in range(len(starts) - 1):
            blocks = batch.block_table[r].tolist()
            seq_len = context_lens[r] + starts[r + 1] - starts[r]
            tokens = [
                int(stored[blocks[p // block_size] * block_size + p % block_size])
                for p in range(seq_len)
            ]
            for i in range(starts[r], starts[r + 1]):
                position = context_lens[r] + i - starts[r]
                out[i, self.next_token(tokens[: position + 1])] = self.logit.detach()[0]
        return out.to(input_ids.device)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            if name != "logit":
                raise ValueError(f"EchoForCausalLM has no weight {name!r}")
            self.logit.data.copy_(tensor)
