"""The layering `make lint` checks (import-linter's contracts in pyproject.toml) holds, and
the check fails on a tree that breaks it; the model runner picks block-keeping linear
methods by what they declare, never by name; a backend's fused decode step recognizes a
model by the block it declares."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any, ClassVar

import pytest

from enginecore.interfaces import LinearMethod
from enginecore.layers.decode_block import DecodeBlock, declared_block, declares_block

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = ["core", *sorted(p.name for p in ROOT.glob("builtin_*") if p.is_dir())]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _copy_tree(dest: Path) -> None:
    """The source roots' Python files and the import-linter settings, nothing else."""
    for root in SOURCE_ROOTS:
        shutil.copytree(
            ROOT / root,
            dest / root,
            ignore=lambda _dir, names: [
                n
                for n in names
                if n in ("__pycache__", "tests")
                or (not n.endswith(".py") and "." in n)
                or n.endswith(".egg-info")
            ],
        )
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    contracts = settings.pop("contracts")
    lines = ["[tool.importlinter]", f"root_packages = {settings['root_packages']!r}"]
    for contract in contracts:
        lines.append("[[tool.importlinter.contracts]]")
        lines += [f"{key} = {value!r}" for key, value in contract.items()]
    (dest / "pyproject.toml").write_text("\n".join(lines).replace("True", "true") + "\n")


def _lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    # The copy's source roots come first on the path, before the editable installs.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(tree / r) for r in SOURCE_ROOTS)}
    return subprocess.run(
        [str(LINT_IMPORTS), str(tree / "pyproject.toml"), "--no-cache"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n{line}\n")


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("layering")
    _copy_tree(dest)
    return dest


def test_the_tree_keeps_every_contract(tree):
    result = _lint_imports(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_each_kind_of_leak_fails_the_check(tree, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tree, broken)
    core = broken / "core" / "enginecore"
    # The contract reaching into the engine, the engine into a built-in, a built-in into
    # another, a backend into a model class, and a module placed in no layer.
    _append(core / "errors.py", "import enginecore.engine.output  # noqa")
    _append(core / "engine" / "output.py", "import enginecore_schedulers.scheduler  # noqa")
    _append(broken / "builtin_gpu/enginecore_gpu/plugin.py", "import enginecore_cpu.attention")
    _append(
        broken / "builtin_attention/enginecore_attention/triton_backend.py",
        "from enginecore_models.models import llama",
    )
    (core / "unplaced.py").write_text('"""In no layer."""\n')
    result = _lint_imports(broken)
    out = result.stdout
    assert result.returncode != 0, out
    broken_names = [line for line in out.splitlines() if "BROKEN" in line]
    for contract in (
        "enginecore layers: tools, engine, contract",
        "enginecore never imports a built-in plugin",
        "built-in plugins never import each other",
        "a backend or linear method never names a model class",
    ):
        assert any(contract in line for line in broken_names), out
    assert "enginecore.errors -> enginecore.engine.output" in out
    assert "enginecore.unplaced" in out  # exhaustive: the unplaced module is named


# --- the runner names no plugin -------------------------------------------------------


class FutureBlocksMethod(LinearMethod):
    """A third party's block-keeping method for CUDA, preferred over the built-in one."""

    name = "future_blocks"
    priority = 5
    devices = ("cuda",)
    gguf_formats: ClassVar[tuple[str, ...]] = ("Q4_0",)

    def create_weights(self, layer: Any, input_size: int, output_size: int, dtype: Any) -> None:
        raise NotImplementedError

    def apply(self, layer: Any, x: Any, bias: Any = None) -> Any:
        raise NotImplementedError


def test_the_block_keeping_method_is_found_by_what_it_declares():
    from enginecore.plugins import make_plugin_manager
    from enginecore_models.model_runner import block_linear_method

    registry = make_plugin_manager().registry("linear_method")
    refs = {name: registry.entry(name).ref for name in registry}
    assert block_linear_method(refs, "cpu", "float32")[0] == "gguf"
    assert block_linear_method(refs, "cuda", "bfloat16")[0] == "gguf_triton"
    refs["future_blocks"] = f"{__name__}:{FutureBlocksMethod.__name__}"
    assert block_linear_method(refs, "cuda", "bfloat16")[0] == "future_blocks"
    assert block_linear_method(refs, "cpu", "float32")[0] == "gguf"
    name, refusals = block_linear_method({"gguf": refs["gguf"]}, "cuda", "bfloat16")
    assert name is None and refusals == ["'gguf' runs on cpu, not cuda"]


def test_the_model_runner_names_no_linear_method_or_backend():
    """The runner's code holds no registered linear method's or attention backend's name
    (``"cpu"``, also a device type, is read as a device)."""
    from enginecore.plugins import make_plugin_manager

    host = make_plugin_manager()
    names = {
        name
        for kind in ("linear_method", "attention_backend")
        for name in host.registry(kind)
        if name not in ("cpu", "cuda")
    }
    source = (ROOT / "builtin_models/enginecore_models/model_runner.py").read_text()
    literals = {
        node.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }
    assert not names & literals


# --- decode blocks are declared, not recognized by class -------------------------------


def test_a_declared_block_belongs_to_the_class_that_declares_it():
    from enginecore_models.models.llama import LlamaForCausalLM, LlamaModel
    from enginecore_models.models.mixtral import MixtralModel
    from enginecore_models.models.qwen3 import Qwen3ForCausalLM, Qwen3Model

    class Plain:
        pass

    @declares_block(DecodeBlock.LLAMA_QK_NORM)
    class Declared:
        pass

    class Subclass(Declared):
        pass

    assert declared_block(Declared()) is DecodeBlock.LLAMA_QK_NORM
    assert declared_block(Subclass()) is None  # a subclass may compute something else
    assert declared_block(Plain()) is None
    blocks = {cls: declared_block(object.__new__(cls)) for cls in (LlamaModel, Qwen3Model)}
    assert blocks == {LlamaModel: DecodeBlock.LLAMA, Qwen3Model: DecodeBlock.LLAMA_QK_NORM}
    assert declared_block(object.__new__(MixtralModel)) is None

    # A causal LM declares that its forward is its stack's; a subclass (a plugin's model,
    # which may override forward) does not.
    class OwnForward(LlamaForCausalLM):
        pass

    assert declared_block(object.__new__(LlamaForCausalLM)) is DecodeBlock.LLAMA
    assert declared_block(object.__new__(Qwen3ForCausalLM)) is DecodeBlock.LLAMA_QK_NORM
    assert declared_block(object.__new__(OwnForward)) is None
