"""AttentionBackendContract: what every attention backend must do, as pytest tests.

Subclass it in your package's tests and name your backend::

    from enginecore.testing import AttentionBackendContract

    class TestMyBackend(AttentionBackendContract):
        backend = "my-backend"   # the registered name (or set backend_cls)
        device = "cuda"
        dtypes = ("bfloat16",)

Each test lays out one or more steps the way the model runner does (decodes first,
contexts already in the cache through shuffled block tables), runs the backend, and
compares with float64 attention computed request by request: fresh prompts, decodes,
chunked prefill after a context, a prefix-cache hit, speculative verification (several
query tokens after a context), a mixed batch, GQA, sliding windows and soft-capping
(where the backend declares them), several steps in a row, and the memory-profiling
pass. The contexts are written in the shared ``[2, blocks, block_size, kv_heads,
head_dim]`` layout; a backend with another layout overrides :meth:`write_context`.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

import pytest
import torch

from enginecore.interfaces import AttentionBackend, AttentionSpec
from enginecore.layers.attention import Attention, AttentionBatch
from enginecore.testing.attention_steps import (
    make_batch,
    reference_attention,
    step_context,
    write_sequences,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class AttentionBackendContract:
    backend: ClassVar[str] = ""
    backend_cls: ClassVar[type[AttentionBackend] | None] = None
    device: ClassVar[str] = "cpu"
    dtypes: ClassVar[tuple[str, ...]] = ("float32",)
    head_dim: ClassVar[int] = 16
    block_size: ClassVar[int] = 4
    # Largest difference from float64 attention allowed, per dtype.
    tolerance: ClassVar[dict[str, float]] = {
        "float32": 1e-4,
        "bfloat16": 3e-2,
        "float16": 5e-3,
    }

    # --- helpers a subclass may override -------------------------------------------

    def backend_class(self) -> type[AttentionBackend]:
        if self.backend_cls is not None:
            return self.backend_cls
        if not self.backend:
            pytest.fail("set `backend` (a registered name) or `backend_cls` on the subclass")
        from enginecore.plugins import make_plugin_manager

        backend_class: type[AttentionBackend] = (
            make_plugin_manager().registry("attention_backend").get(self.backend)
        )
        return backend_class

    def make_backend(self, spec: AttentionSpec) -> AttentionBackend:
        return self.backend_class()(spec)

    def write_context(
        self, cache: Any, keys: list[torch.Tensor], values: list[torch.Tensor], batch: Any
    ) -> None:
        write_sequences(cache, keys, values, batch)

    # --- the harness --------------------------------------------------------------

    def _spec(self, dtype: str, heads: int, kv_heads: int, **flags: bool) -> AttentionSpec:
        return AttentionSpec(
            num_layers=1,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=self.head_dim,
            dtype=_DTYPES[dtype],
            device=torch.device(self.device),
            block_size=self.block_size,
            max_model_len=256,
            max_num_seqs=8,
            max_num_batched_tokens=256,
            **flags,
        )

    def run_steps(
        self,
        steps: list[list[tuple[int, int]]],
        *,
        dtype: str = "float32",
        heads: int = 4,
        kv_heads: int = 2,
        window: int | None = None,
        cap: float | None = None,
        seed: int = 0,
    ) -> None:
        """Run ``steps`` (each a list of (context_len, query_len) per request, decodes
        first; request ``r`` keeps its blocks across steps) through one backend and
        compare every step's output with the reference."""
        gen = torch.Generator().manual_seed(seed)
        tdtype, dev = _DTYPES[dtype], torch.device(self.device)
        num_reqs = max(len(s) for s in steps)
        seq_len = [
            max(c + q for step in steps for c, q in step[r : r + 1]) for r in range(num_reqs)
        ]
        keys = [torch.randn(n, kv_heads, self.head_dim, generator=gen).to(tdtype) for n in seq_len]
        values = [
            torch.randn(n, kv_heads, self.head_dim, generator=gen).to(tdtype) for n in seq_len
        ]
        need = [-(-n // self.block_size) for n in seq_len]
        ids = list(range(sum(need) + 3))
        random.Random(seed).shuffle(ids)  # scattered blocks: the tables must be followed
        tables, at = [], 0
        for n in need:
            tables.append(ids[at : at + n])
            at += n
        spec = self._spec(
            dtype,
            heads,
            kv_heads,
            sliding_window=window is not None,
            logits_soft_cap=cap is not None,
        )
        backend = self.make_backend(spec)
        cache = backend.allocate_kv_cache(len(ids))[0]
        layer = Attention(
            heads,
            self.head_dim,
            self.head_dim**-0.5,
            kv_heads,
            sliding_window=window,
            logits_soft_cap=cap,
        )
        first = steps[0]
        ctx_batch = make_batch(
            [q for _, q in first], [c for c, _ in first], tables[: len(first)], self.block_size
        )
        self.write_context(cache, keys, values, ctx_batch)
        tol = self.tolerance[dtype]
        for step in steps:
            batch = make_batch(
                [q for _, q in step], [c for c, _ in step], tables[: len(step)], self.block_size
            )
            qs = torch.randn(batch.num_tokens, heads, self.head_dim, generator=gen).to(tdtype)
            new_k = torch.cat([keys[r][c : c + q] for r, (c, q) in enumerate(step)])
            new_v = torch.cat([values[r][c : c + q] for r, (c, q) in enumerate(step)])
            ctx = step_context(backend, batch)
            with torch.inference_mode():
                out = backend.forward(
                    layer, qs.to(dev), new_k.to(dev), new_v.to(dev), cache, ctx.metadata
                )
            seqs_k = [keys[r][: c + q] for r, (c, q) in enumerate(step)]
            seqs_v = [values[r][: c + q] for r, (c, q) in enumerate(step)]
            want = reference_attention(qs, seqs_k, seqs_v, batch, layer.scale, window, cap)
            got = out.float().cpu()
            err = (got - want.float()).abs().max().item()
            assert err <= tol, f"step {step}: largest difference {err:.3g} > {tol:g} ({dtype})"
            self._check_written(cache, new_k, new_v, batch)

    def _check_written(self, cache: Any, key: Any, value: Any, batch: AttentionBatch) -> None:
        if tuple(cache.shape[2:]) != (self.block_size, *key.shape[1:]):
            return  # a backend's own layout: its write is checked through the outputs
        flat = cache.view(2, -1, *key.shape[1:]).cpu()
        slots = torch.from_numpy(batch.slot_mapping)
        assert torch.equal(flat[0][slots], key.to(flat.dtype)), "K not written at its slots"
        assert torch.equal(flat[1][slots], value.to(flat.dtype)), "V not written at its slots"

    # --- the contract ----------------------------------------------------------------

    def test_declares_its_name_and_capabilities(self) -> None:
        cls = self.backend_class()
        assert cls.name, "a backend class needs a `name`"
        assert (
            self.device in cls.capabilities.devices
            or cls.unsupported_reason(self._spec(self.dtypes[0], 4, 2), by_name=True) is None
        )
        assert cls.capabilities.describe()

    def test_refuses_a_device_it_does_not_declare(self) -> None:
        cls = self.backend_class()
        spec = AttentionSpec(
            1, 4, 2, self.head_dim, torch.float32, torch.device("meta"), self.block_size, 64, 4, 64
        )
        assert cls.unsupported_reason(spec) is not None

    @pytest.mark.parametrize("dtype_index", [0, 1, 2])
    def test_fresh_prompts(self, dtype_index: int) -> None:
        if dtype_index >= len(self.dtypes):
            pytest.skip("dtype not declared by this contract subclass")
        self.run_steps([[(0, 5), (0, 5), (0, 9)]], dtype=self.dtypes[dtype_index])

    def test_decodes(self) -> None:
        self.run_steps([[(7, 1), (12, 1), (1, 1)]])

    def test_chunked_prefill_after_a_context(self) -> None:
        self.run_steps([[(6, 7)]])

    def test_prefix_cache_hit(self) -> None:
        # A context of whole blocks, as a prefix-cache hit leaves it, then the rest.
        self.run_steps([[(2 * self.block_size, 5)]])

    def test_speculative_verification(self) -> None:
        self.run_steps([[(9, 4), (3, 3)]])

    def test_mixed_batch(self) -> None:
        self.run_steps([[(10, 1), (4, 1), (0, 6), (5, 3), (0, 6)]])

    @pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2)])
    def test_grouped_query_attention(self, heads: int, kv_heads: int) -> None:
        self.run_steps([[(5, 1), (0, 7)]], heads=heads, kv_heads=kv_heads)

    def test_steps_in_a_row(self) -> None:
        # Prefill, then decodes that keep their order, then one leaves and one joins.
        self.run_steps([[(0, 6), (0, 3)], [(6, 1), (3, 1)], [(7, 1), (4, 1)], [(8, 1)]])

    def test_sliding_window(self) -> None:
        if not self.backend_class().capabilities.sliding_window:
            pytest.skip("the backend does not declare sliding-window support")
        self.run_steps([[(11, 1), (0, 9), (7, 4)]], window=4)

    def test_soft_cap(self) -> None:
        if not self.backend_class().capabilities.logits_soft_cap:
            pytest.skip("the backend does not declare soft-capping")
        self.run_steps([[(6, 1), (0, 5), (4, 3)]], cap=0.5)

    def test_profiling_pass_without_a_cache(self) -> None:
        spec = self._spec(self.dtypes[0], 4, 2)
        backend = self.make_backend(spec)
        layer = Attention(4, self.head_dim, self.head_dim**-0.5, 2)
        lens = [5, 3]
        tdtype, dev = _DTYPES[self.dtypes[0]], torch.device(self.device)
        q = torch.randn(8, 4, self.head_dim).to(tdtype)
        k = torch.randn(8, 2, self.head_dim).to(tdtype)
        v = torch.randn(8, 2, self.head_dim).to(tdtype)
        with torch.inference_mode():
            out = backend.forward(
                layer, q.to(dev), k.to(dev), v.to(dev), None, backend.build_profile_metadata(lens)
            )
        batch = make_batch(lens, [0, 0], [[0, 1], [2]], self.block_size)
        want = reference_attention(q, [k[:5], k[5:]], [v[:5], v[5:]], batch, layer.scale)
        err = (out.float().cpu() - want.float()).abs().max().item()
        assert err <= self.tolerance[self.dtypes[0]]
