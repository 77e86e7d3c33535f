"""``SpecDecodeProposerContract``: what every speculative-decoding proposer owes the engine.

Subclass it in your own pytest tests and point it at your proposer::

    from enginecore.testing import SpecDecodeProposerContract

    class TestMyProposer(SpecDecodeProposerContract):
        proposer = "my-proposer"      # a registered name, or the class itself

The suite checks the ``propose`` contract — at most ``max_num_drafts`` non-negative int
token ids, none for ``max_num_drafts = 0``, any context length from one token, the
input array left alone (it is read-only), deterministic across calls and instances (each
rank of a parallel engine proposes for itself) — and then runs the real engine core on a
small random checkpoint with the proposer selected: greedy output must equal the output
without speculation, token for token.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

import numpy as np
import pytest

from enginecore.config import EngineConfig, make_config
from enginecore.interfaces import SpecDecodeProposer


class SpecDecodeProposerContract:
    #: The registered name, or the :class:`SpecDecodeProposer` subclass itself.
    proposer: ClassVar[Any] = None
    #: Extra config (flat names) the proposer needs, e.g. its own settings.
    config_overrides: ClassVar[dict[str, Any]] = {}
    num_speculative_tokens: ClassVar[int] = 4

    # --- helpers -------------------------------------------------------------------------

    def _name_and_class(self) -> tuple[str | None, type]:
        if self.proposer is None:
            pytest.fail("set `proposer` to a registered name or a SpecDecodeProposer class")
        if isinstance(self.proposer, str):
            from enginecore.plugins import make_plugin_manager

            registry = make_plugin_manager(strict=False).registry("spec_decode_proposer")
            return self.proposer, registry.get(self.proposer)
        return None, self.proposer

    def make_config(self, **overrides: Any) -> EngineConfig:
        name, _ = self._name_and_class()
        settings: dict[str, Any] = dict(
            speculative_method=name or "contract",
            num_speculative_tokens=self.num_speculative_tokens,
        )
        settings.update(self.config_overrides)
        settings.update(overrides)
        return make_config(**settings)

    def make(self) -> SpecDecodeProposer:
        _, cls = self._name_and_class()
        proposer: SpecDecodeProposer = cls(self.make_config())
        return proposer

    @staticmethod
    def contexts() -> list[np.ndarray]:
        rng = random.Random(0)
        out = [[5], [5, 5], [1, 2, 3, 1, 2, 3, 1, 2], list(range(40))]
        unit = [rng.randrange(100) for _ in range(7)]
        out.append(unit * 6 + unit[:3])
        out.append([rng.randrange(1000) for _ in range(3000)])
        arrays = []
        for tokens in out:
            array = np.array(tokens, dtype=np.int64)
            array.flags.writeable = False
            arrays.append(array)
        return arrays

    # --- the contract ----------------------------------------------------------------------

    def test_is_a_spec_decode_proposer(self) -> None:
        _, cls = self._name_and_class()
        assert isinstance(cls, type) and issubclass(cls, SpecDecodeProposer)

    def test_proposes_at_most_max_num_drafts_token_ids(self) -> None:
        proposer = self.make()
        for context in self.contexts():
            for k in (1, 3, self.num_speculative_tokens):
                drafts = list(proposer.propose(context, k))
                assert len(drafts) <= k, (len(context), k, drafts)
                for token in drafts:
                    assert isinstance(token, (int, np.integer)) and int(token) >= 0, drafts
            assert list(proposer.propose(context, 0)) == []

    def test_is_deterministic_across_calls_and_instances(self) -> None:
        first, second = self.make(), self.make()
        for context in self.contexts():
            expected = [int(t) for t in first.propose(context, self.num_speculative_tokens)]
            again = [int(t) for t in first.propose(context, self.num_speculative_tokens)]
            other = [int(t) for t in second.propose(context, self.num_speculative_tokens)]
            assert again == expected and other == expected

    @pytest.fixture(scope="class")
    def contract_checkpoint(self, tmp_path_factory: pytest.TempPathFactory) -> Any:
        """A small random Llama checkpoint; override to reuse one your tests already have."""
        from enginecore.checkpoints import make_random_checkpoint

        return make_random_checkpoint(tmp_path_factory.mktemp("proposer-contract") / "llama")

    def test_engine_output_is_unchanged(self, contract_checkpoint: Any) -> None:
        """The real engine core, greedy, with and without the proposer."""
        from enginecore.engine.core import EngineCore
        from enginecore.params import SamplingParams
        from enginecore.protocol import EngineCoreRequest

        name, cls = self._name_and_class()
        path = contract_checkpoint
        rng = random.Random(1)
        prompts = []
        for i in range(6):
            unit = [rng.randrange(10, 8000) for _ in range(3 + i)]
            prompts.append(unit * 3 if i % 2 == 0 else unit)
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        common: dict[str, Any] = dict(model=str(path), dtype="float32", num_blocks_override=128)
        results = []
        for spec in (False, True):
            config = self.make_config(**common) if spec else make_config(**common)
            engine = _engine_with(EngineCore, config, cls if name is None else None)
            try:
                tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
                for i, prompt in enumerate(prompts):
                    engine.add_request(EngineCoreRequest(str(i), prompt, params, 0.0))
                step = engine.step_fn()
                while engine.has_work():
                    outputs, _ = step()
                    for client in outputs.values():
                        for out in client.outputs:
                            tokens[out.request_id].extend(out.new_token_ids)
                results.append(tokens)
            finally:
                engine.shutdown()
        assert results[1] == results[0]


def _engine_with(engine_cls: Any, config: EngineConfig, unregistered: type | None) -> Any:
    """An engine core; an unregistered proposer class is added as plugin ``contract``."""
    from enginecore.hookspecs import hookimpl
    from enginecore.plugins import make_plugin_manager

    host = make_plugin_manager(config.plugins.enabled, config.plugins.disabled, strict=False)
    if unregistered is not None:

        class _Contract:
            @hookimpl
            def register_spec_decode_proposers(self, registry: Any) -> None:
                registry.add("contract", unregistered)

        host.register_object(_Contract(), "contract")
    return engine_cls(config, host)
