"""One table knows the component kinds; what the other places said of each kind is now
derived from it, so no kind is missing from one of them."""

from __future__ import annotations

import pytest

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
