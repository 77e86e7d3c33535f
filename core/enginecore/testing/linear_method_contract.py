"""LinearMethodContract: what every linear method must do, as pytest tests.

Subclass it and name your method::

    from enginecore.testing import LinearMethodContract

    class TestMyMethod(LinearMethodContract):
        method = "my-method"   # the registered name (or set method_cls)

The tests build the core linear layers under your method, load a checkpoint tensor
through each parameter's ``weight_loader``, call ``process_weights_after_loading`` and
compare ``forward`` with ``F.linear`` on the loaded weight, in the declared dtypes, from
one row to a prefill-sized batch: plain, biased, row-parallel, fused QKV and a gated
gate/up projection (whose ``fused_silu_and_mul``, where given, must equal
``silu(gate) * up``). A quantizing method sets ``tolerance`` to its error bound.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F

from enginecore.distributed import SINGLE_RANK
from enginecore.interfaces import LinearMethod
from enginecore.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    use_linear_method,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LinearMethodContract:
    method: ClassVar[str] = ""
    method_cls: ClassVar[type[LinearMethod] | None] = None
    device: ClassVar[str] = "cpu"
    dtypes: ClassVar[tuple[str, ...]] = ("float32",)
    # Largest difference from F.linear, relative to the output's largest magnitude.
    tolerance: ClassVar[dict[str, float]] = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}

    def method_class(self) -> type[LinearMethod]:
        if self.method_cls is not None:
            return self.method_cls
        if not self.method:
            pytest.fail("set `method` (a registered name) or `method_cls` on the subclass")
        from enginecore.plugins import make_plugin_manager

        method_class: type[LinearMethod] = (
            make_plugin_manager().registry("linear_method").get(self.method)
        )
        return method_class

    def build(self, factory: Any, dtype: str) -> Any:
        with torch.device(self.device), use_linear_method(self.method_class()(None)):
            return factory(_DTYPES[dtype])

    def load(self, layer: Any, tensors: dict[str, Any]) -> None:
        """Load ``{param name: (tensor, shard)}`` as a checkpoint would, then finish."""
        params = dict(layer.named_parameters())
        with torch.no_grad():
            for name, (tensor, shard) in tensors.items():
                param = params[name]
                if shard is None:
                    param.weight_loader(param, tensor)
                else:
                    param.weight_loader(param, tensor, shard)
        layer.linear_method.process_weights_after_loading(layer)

    def check(self, got: torch.Tensor, want: torch.Tensor, dtype: str) -> None:
        scale = want.float().abs().max().item() or 1.0
        err = (got.float() - want.float()).abs().max().item() / scale
        assert err <= self.tolerance[dtype], f"relative error {err:.3g} ({dtype})"

    def _inputs(self, k: int, dtype: str) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(k)
        return [
            torch.randn(rows, k, generator=gen).to(_DTYPES[dtype]).to(self.device)
            for rows in (1, 3, 37, 300)
        ]

    # --- the contract ----------------------------------------------------------------

    def test_declares_its_name(self) -> None:
        cls = self.method_class()
        assert cls.name, "a linear method class needs a `name`"
        assert cls.unsupported_reason(self.device, self.dtypes[0]) is None

    @pytest.mark.parametrize("bias", [False, True])
    def test_column_parallel_matches_f_linear(self, bias: bool) -> None:
        for dtype in self.dtypes:
            layer = self.build(
                lambda dt, bias=bias: ColumnParallelLinear(
                    64, 96, bias=bias, parallel=SINGLE_RANK, dtype=dt
                ),
                dtype,
            )
            w = torch.randn(96, 64).to(_DTYPES[dtype])
            b = torch.randn(96).to(_DTYPES[dtype])
            self.load(layer, {"weight": (w, None), **({"bias": (b, None)} if bias else {})})
            for x in self._inputs(64, dtype):
                want = F.linear(x.float().cpu(), w.float(), b.float() if bias else None)
                self.check(layer(x).cpu(), want, dtype)

    def test_row_parallel_matches_f_linear(self) -> None:
        for dtype in self.dtypes:
            layer = self.build(
                lambda dt: RowParallelLinear(128, 64, bias=True, parallel=SINGLE_RANK, dtype=dt),
                dtype,
            )
            w = torch.randn(64, 128).to(_DTYPES[dtype])
            b = torch.randn(64).to(_DTYPES[dtype])
            self.load(layer, {"weight": (w, None), "bias": (b, None)})
            for x in self._inputs(128, dtype):
                self.check(layer(x).cpu(), F.linear(x.float().cpu(), w.float(), b.float()), dtype)

    def test_fused_qkv_loads_each_shard(self) -> None:
        for dtype in self.dtypes:
            layer = self.build(
                lambda dt: QKVParallelLinear(
                    64, 16, 4, 2, bias=False, parallel=SINGLE_RANK, dtype=dt
                ),
                dtype,
            )
            q, k, v = (torch.randn(n, 64).to(_DTYPES[dtype]) for n in (64, 32, 32))
            params = dict(layer.named_parameters())
            with torch.no_grad():
                for shard, tensor in (("q", q), ("k", k), ("v", v)):
                    params["weight"].weight_loader(params["weight"], tensor, shard)
            layer.linear_method.process_weights_after_loading(layer)
            w = torch.cat((q, k, v)).float()
            for x in self._inputs(64, dtype):
                self.check(layer(x).cpu(), F.linear(x.float().cpu(), w), dtype)

    def test_gated_projection(self) -> None:
        for dtype in self.dtypes:
            layer = self.build(
                lambda dt: MergedColumnParallelLinear(
                    64, [128, 128], bias=False, parallel=SINGLE_RANK, dtype=dt, gated=True
                ),
                dtype,
            )
            gate, up = (torch.randn(128, 64).to(_DTYPES[dtype]) for _ in range(2))
            self.load(layer, {"weight": (torch.cat((gate, up)), None)})
            for x in self._inputs(64, dtype):
                xf = x.float().cpu()
                want = F.silu(F.linear(xf, gate.float())) * F.linear(xf, up.float())
                fused = layer.fused_silu_and_mul(x)
                if fused is not None:
                    self.check(fused.cpu(), want, dtype)
                g, u = layer(x).float().cpu().chunk(2, dim=-1)
                self.check(F.silu(g) * u, want, dtype)
