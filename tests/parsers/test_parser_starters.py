"""``enginecore plugin new --kind tool-parser`` / ``reasoning-parser``: each generated
package installs into a fresh venv, is found through its entry point, and passes its own
tests (the parser conformance kit on the starter's format) as generated."""

from __future__ import annotations

import pytest

from enginecore.starter.cli import StarterError, create_plugin
from tests.helpers.starter import build_and_test


def test_a_new_tool_parser_plugin_installs_and_passes_its_tests(tmp_path, tiny_llama):
    build_and_test("tool-parser", tmp_path, tiny_llama, select_in_engine=False)


@pytest.mark.slow
def test_a_new_reasoning_parser_plugin_installs_and_passes_its_tests(tmp_path, tiny_llama):
    build_and_test("reasoning-parser", tmp_path, tiny_llama, select_in_engine=False)


def test_the_parser_kinds_render_and_unknown_kinds_are_refused(tmp_path):
    package = create_plugin("enginecore-think", "reasoning-parser", tmp_path / "think")
    plugin = (package / "src" / "enginecore_think" / "plugin.py").read_text()
    assert "def register_reasoning_parsers(registry)" in plugin
    assert '"think", "enginecore_think.parser:ThinkReasoningParser"' in plugin
    readme = (package / "README.md").read_text()
    assert "enginecore serve MODEL --reasoning-parser think" in readme
    with pytest.raises(StarterError, match="unknown plugin kind"):
        create_plugin("enginecore-x", "tool_parsers", tmp_path / "x")
