"""Shared fixtures: random-weight checkpoints made once per test session, offline."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import pytest

# The plugin packages under plugins/ carry their own tests, which need the package
# installed: the tests that install them run those (test_backend_plugins.py).
collect_ignore = ["plugins"]

# enginecore's conformance kit: its contracts and fixtures (loaded only when named).
pytest_plugins = ["enginecore.testing"]

CheckpointFactory = Callable[..., pathlib.Path]


@pytest.fixture(autouse=True)
def _plugin_warnings_per_test(monkeypatch):
    """A plugin failure is warned once per process tree; each test is its own tree."""
    monkeypatch.setenv("ENGINECORE_WARNED_PLUGINS", "")


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    """``factory(arch="llama", size="tiny", seed=0, sliding_window=None)`` -> checkpoint
    dir, made once per key."""
    from enginecore.checkpoints import make_random_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    made: dict[tuple[str, str, int, int | None], pathlib.Path] = {}

    def factory(
        arch: str = "llama", size: str = "tiny", seed: int = 0, sliding_window: int | None = None
    ) -> pathlib.Path:
        key = (arch, size, seed, sliding_window)
        if key not in made:
            suffix = f"-sw{sliding_window}" if sliding_window is not None else ""
            made[key] = make_random_checkpoint(
                root / f"{arch}-{size}-{seed}{suffix}",
                arch=arch,
                size=size,
                seed=seed,
                sliding_window=sliding_window,
            )
        return made[key]

    return factory


@pytest.fixture(scope="session")
def tiny_llama(checkpoint_factory: CheckpointFactory) -> pathlib.Path:
    return checkpoint_factory("llama")


@pytest.fixture(scope="session")
def tiny_qwen2(checkpoint_factory: CheckpointFactory) -> pathlib.Path:
    return checkpoint_factory("qwen2")


@pytest.fixture(scope="session")
def tiny_mistral(checkpoint_factory: CheckpointFactory) -> pathlib.Path:
    return checkpoint_factory("mistral")


@pytest.fixture(scope="session")
def tiny_gpt2(checkpoint_factory: CheckpointFactory) -> pathlib.Path:
    return checkpoint_factory("gpt2")


@pytest.fixture(scope="session")
def model_refs() -> dict[str, str]:
    """Architecture -> ``module:Class``, from the real plugin manager's built-ins."""
    from enginecore.plugins import make_plugin_manager

    registry = make_plugin_manager(load_entrypoints=False).registry("model")
    return {name: registry.entry(name).ref for name in registry.names()}


@pytest.fixture(scope="session")
def enginecore_model(tiny_llama: pathlib.Path) -> pathlib.Path:
    """The conformance kit's engine fixtures serve the suite's own tiny checkpoint."""
    return tiny_llama
