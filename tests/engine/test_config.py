"""EngineConfig: file < flags < validation, flat names, clear errors."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from enginecore.cli import main
from enginecore.config import (
    FLAT_NAMES,
    SECTIONS,
    EngineConfig,
    field_docs,
    make_config,
)
from enginecore.errors import ConfigError


def test_defaults() -> None:
    config = make_config()
    assert isinstance(config, EngineConfig)
    assert config.cache.block_size is None and config.cache.tokens_per_block == 16
    assert config.cache.prefix_caching is True
    assert config.scheduler.name == "default"
    assert config.scheduler.policy == "fcfs"
    assert config.parallel.executor == "auto"


def test_flat_names_are_unique_and_cover_every_field() -> None:
    fields = {(s, f) for s, cls in SECTIONS.items() for f in cls.__struct_fields__}
    assert set(FLAT_NAMES.values()) == fields
    assert FLAT_NAMES["model"] == ("model", "path")
    assert FLAT_NAMES["scheduling_policy"] == ("scheduler", "policy")
    assert FLAT_NAMES["max_num_seqs"] == ("scheduler", "max_num_seqs")


def test_every_field_is_documented() -> None:
    docs = field_docs()
    undocumented = {
        name
        for name in FLAT_NAMES
        if name not in docs
        and name not in {"tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"}
    }
    # Server and speculative knobs are described in docs/configuration.md instead.
    assert "max_num_seqs" in docs and "block_size" in docs and "model" in docs
    assert len(undocumented) < len(FLAT_NAMES) / 2


def test_flat_keywords_and_section_dicts() -> None:
    config = make_config(
        model="/m", max_num_seqs=7, tensor_parallel_size=2, kv_transfer={"connector": "x"}
    )
    assert config.model.path == "/m"
    assert config.scheduler.max_num_seqs == 7
    assert config.parallel.tensor_parallel_size == 2
    assert config.parallel.world_size == 2
    assert config.kv_transfer.connector == "x"


@pytest.mark.parametrize("suffix", ["toml", "yaml", "json"])
def test_file_formats_then_overrides(tmp_path, suffix: str) -> None:
    data = {"model": "/ckpt", "scheduler": {"max_num_seqs": 3, "policy": "priority"}}
    path = tmp_path / f"engine.{suffix}"
    if suffix == "toml":
        path.write_text('model = "/ckpt"\n[scheduler]\nmax_num_seqs = 3\npolicy = "priority"\n')
    elif suffix == "yaml":
        path.write_text("model: /ckpt\nscheduler:\n  max_num_seqs: 3\n  policy: priority\n")
    else:
        path.write_text(json.dumps(data))
    config = make_config(path)
    assert config.model.path == "/ckpt"
    assert config.scheduler.max_num_seqs == 3
    assert config.scheduler.policy == "priority"
    # flags/keywords win over the file; None means "not given"
    config = make_config(path, max_num_seqs=9, scheduling_policy=None)
    assert config.scheduler.max_num_seqs == 9
    assert config.scheduler.policy == "priority"


def test_wrong_type_names_key_path_and_flag() -> None:
    with pytest.raises(ConfigError) as info:
        make_config(max_num_seqs="many")
    message = str(info.value)
    assert "$.scheduler.max_num_seqs" in message
    assert "Expected `int`" in message
    assert "--max-num-seqs" in message


def test_unknown_flat_key_suggests_close_names() -> None:
    with pytest.raises(ConfigError, match=r"unknown config key .max_num_seq.*max_num_seqs"):
        make_config(max_num_seq=3)


def test_unknown_key_in_file_section(tmp_path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[scheduler]\nmax_num_seqz = 3\n")
    with pytest.raises(ConfigError, match=r"unknown field `max_num_seqz`.*\$\.scheduler"):
        make_config(path)


def test_unknown_section_in_file(tmp_path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[schedulr]\nmax_num_seqs = 3\n")
    with pytest.raises(ConfigError, match=r"unknown config key .schedulr.*scheduler"):
        make_config(path)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"block_size": 0}, "block_size must be >= 1"),
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"dtype": "float64"}, "Invalid enum value 'float64'"),
    ],
)
def test_bad_values_rejected(overrides, needle) -> None:
    with pytest.raises(ConfigError, match=needle):
        make_config(**overrides)


def test_bad_file(tmp_path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="does not exist"):
        make_config(missing)
    broken = tmp_path / "broken.toml"
    broken.write_text("[scheduler\n")
    with pytest.raises(ConfigError, match="not valid toml"):
        make_config(broken)
    other = tmp_path / "engine.ini"
    other.write_text("x")
    with pytest.raises(ConfigError, match="unknown format"):
        make_config(other)


def test_replace_revalidates() -> None:
    config = make_config(model="/m")
    changed = config.replace(block_size=32)
    assert changed.cache.block_size == 32 and config.cache.block_size is None
    with pytest.raises(ConfigError):
        config.replace(block_size="big")


def _cli(*args: str) -> tuple[int, str, str]:
    """``enginecore ARGS`` through the command's ``main`` in this process (the command
    line is the subject, not an interpreter start): exit status, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's refusals
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def test_cli_config_show_resolves_file_and_flags(tmp_path) -> None:
    path = tmp_path / "engine.toml"
    path.write_text('[scheduler]\nmax_num_seqs = 3\npolicy = "priority"\n')
    code, out, err = _cli(
        "config", "show", "--config", str(path), "--block-size", "32", "--format", "json"
    )
    assert code == 0, err
    data = json.loads(out)
    assert data["scheduler"]["max_num_seqs"] == 3
    assert data["scheduler"]["policy"] == "priority"
    assert data["cache"]["block_size"] == 32


def test_cli_config_show_bad_value_is_a_clear_error() -> None:
    code, _, err = _cli("config", "show", "--kv-connector-extra-config", "[1]")
    assert code == 2
    assert "kv_transfer.extra_config" in err
    assert "Traceback" not in err


def test_cli_boolean_flags() -> None:
    code, out, err = _cli("config", "show", "--no-prefix-caching", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["cache"]["prefix_caching"] is False


def test_cli_config_show_masks_the_api_key() -> None:
    for fmt in ("json", "toml"):
        code, out, err = _cli("config", "show", "--api-key", "s3cret-token", "--format", fmt)
        assert code == 0, err
        assert "s3cret-token" not in out and "********" in out


def test_every_config_flag_has_help_text() -> None:
    """``enginecore serve --help`` explains every flag (the text is the field's docstring)."""
    import argparse

    from enginecore.config import add_config_flags

    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    bare = [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help]
    assert bare == [] or bare == ["-h"], f"flags without help: {bare}"


def test_several_served_model_names_as_a_list_are_the_first_name_and_aliases() -> None:
    """``LLM(served_model_name=["a", "b"])`` and a config file's list, as vLLM's EngineArgs take it."""
    config = make_config(served_model_name=["a", "b", "c"])
    assert config.model.served_model_name == "a"
    assert config.model.served_model_aliases == ["b", "c"]
    assert make_config(served_model_name=["only"]).model.served_model_aliases == []
    with pytest.raises(ConfigError, match="served_model_name"):
        make_config(served_model_name=[])
