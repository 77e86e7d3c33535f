"""One table knows the component kinds; what the other places said of each kind is now
derived from it, so no kind is missing from one of them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import enginecore
from enginecore import hookspecs, make_config
from enginecore.component_check import selected_components
from enginecore.component_kinds import COMPONENT_KINDS, KINDS
from enginecore.plugins import COMPONENT_HOOKS, make_plugin_manager
from enginecore.startup_errors import ComponentStartupError, build_component


@pytest.fixture(scope="module")
def host():
    return make_plugin_manager()


def test_every_registration_hook_is_one_row():
    hooks = {name for name in vars(hookspecs) if name.startswith("register_")}
    assert {kind.hook for kind in COMPONENT_KINDS} == hooks
    assert len(KINDS) == len(COMPONENT_KINDS) == len(COMPONENT_HOOKS)


def _broken(*args, **kwargs):
    raise RuntimeError("broken on purpose")


@pytest.mark.parametrize(
    ("kind", "name", "key"),
    [
        ("spec_decode_proposer", "ngram", "speculative.speculative_method"),
        ("tool_parser", "hermes", "server.tool_call_parser"),
        ("attention_backend", "torch", "model.attention_backend"),
        ("scheduler", "default", "scheduler.name"),
    ],
)
def test_a_failing_component_names_the_config_key_that_selects_it(host, kind, name, key):
    with pytest.raises(ComponentStartupError) as info:
        build_component(host, kind, name, _broken, make_config(model="x"))
    assert f"(config key {key})" in str(info.value)


def test_the_config_check_covers_every_selectable_kind():
    config = make_config(
        model="x",
        scheduler_name="s",
        scheduling_policy="p",
        executor="e",
        runner="r",
        attention_backend="a",
        linear_method="l",
        kv_connector="k",
        stat_loggers=["st"],
        structured_output_backend="so",
        speculative_method="sd",
        num_speculative_tokens=1,
        tool_call_parser="tp",
        reasoning_parser="rp",
    )
    kinds = {kind for kind, _key, _name in selected_components(config)}
    assert kinds == {k.name for k in COMPONENT_KINDS if k.selected is not None}
    assert kinds == set(COMPONENT_HOOKS) - {"model", "worker_rpc"}


# --- no other module lists kinds ---------------------------------------------------------

PACKAGE = Path(enginecore.__file__).parent
TABLE = PACKAGE / "component_kinds.py"
#: Kind names that are also config keywords (``make_config(model=..., executor=...)``).
CONFIG_FIELDS = {"model", "executor"}


def _kind_names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Dict):
        items: list[ast.expr | None] = list(node.keys)
    elif isinstance(node, ast.List | ast.Tuple | ast.Set):
        items = list(node.elts)
    else:
        return []
    return [
        item.value
        for item in items
        if isinstance(item, ast.Constant) and isinstance(item.value, str) and item.value in KINDS
    ]


def test_no_module_but_the_table_lists_component_kinds():
    tables = []
    for source in sorted(PACKAGE.rglob("*.py")):
        if source == TABLE:
            continue
        for node in ast.walk(ast.parse(source.read_text(), str(source))):
            names = _kind_names(node)
            # ``{"model": path, "executor": name}`` is a config, not a table of kinds.
            if len(names) >= 2 and not set(names) <= CONFIG_FIELDS:
                where = f"{source.relative_to(PACKAGE)}:{getattr(node, 'lineno', '?')}"
                tables.append(f"{where} {names}")
    assert tables == [], "kind tables outside component_kinds.py:\n" + "\n".join(tables)


def test_the_registration_check_reads_the_table():
    """Each kind's row drives the registration check: its base class, the attributes
    read from every entry and the call shape of its factory."""
    from enginecore.registration_check import factory_problem, registration_problem

    for kind in KINDS.values():
        if kind.required_attributes:
            problem = registration_problem(kind.name, "x", type("Plain", (), {}))
            assert problem is not None and all(a in problem for a in kind.required_attributes)
        if kind.base is not None:
            problem = factory_problem(kind.name, "x", type("Plain", (), {}))
            assert problem is not None and kind.base.__name__ in problem, kind.name
        if kind.called_with is not None and kind.base is None:
            problem = registration_problem(kind.name, "x", lambda: None)
            assert problem is not None and kind.called_with[1] in problem, kind.name
