"""docs/hooks.md is what docs/gen_hook_reference.py makes of hookspecs.py today."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.script_module import load_script

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    return load_script("docs/gen_hook_reference.py")


def test_the_hook_reference_is_current():
    page = (ROOT / "docs" / "hooks.md").read_text()
    assert page == _generator().render(), (
        "docs/hooks.md is stale: run python docs/gen_hook_reference.py"
    )


def test_every_hook_and_kind_is_in_the_reference(monkeypatch):
    from enginecore import hookspecs
    from enginecore.component_kinds import COMPONENT_KINDS

    generator = _generator()
    page = generator.render()
    for kind in COMPONENT_KINDS:
        assert f"### `{kind.hook}(" in page and f"Fills the `{kind.name}` registry" in page
    # A changed docstring changes the page: the staleness check can fail.
    monkeypatch.setattr(hookspecs.engine_stopped, "__doc__", "Changed.")
    assert generator.render() != page
