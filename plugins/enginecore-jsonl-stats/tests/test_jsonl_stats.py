"""Tests of the JSONL stat logger. Run with the package installed (``pip install -e .``)."""

from __future__ import annotations

import json

from enginecore_jsonl_stats import PATH_ENV_VAR, JsonlStatLogger

import enginecore
from enginecore import make_config
from enginecore.interfaces import IterationStats
from enginecore.metrics.stats import FinishedRequestStats
from enginecore.protocol import SchedulerStats
from enginecore.request import FinishReason
from enginecore.testing import StatLoggerContract


class TestJsonlContract(StatLoggerContract):
    """enginecore's conformance kit, with each logger writing to a temporary file."""

    stat_logger = "jsonl"

    def make_logger(self, engine_index: int = 0) -> JsonlStatLogger:
        import tempfile

        path = f"{tempfile.mkdtemp()}/stats.jsonl"
        return self.logger_class()(self.make_config(), engine_index, path=path)


def finished(request_id: str, **extra) -> FinishedRequestStats:
    return FinishedRequestStats(
        request_id=request_id,
        finish_reason=FinishReason.STOP,
        num_prompt_tokens=7,
        num_generation_tokens=3,
        e2e_latency=0.5,
        ttft=0.1,
        extra=extra or None,
    )


def test_one_line_per_record_call(tmp_path, monkeypatch):
    path = tmp_path / "out" / "stats.jsonl"
    monkeypatch.setenv(PATH_ENV_VAR, str(path))
    logger = JsonlStatLogger(make_config(model="tiny-model"), engine_index=0)
    logger.record(
        SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.5),
        IterationStats(num_prompt_tokens=12, num_generation_tokens=2),
    )
    logger.record(
        SchedulerStats(num_running_reqs=0),
        IterationStats(num_generation_tokens=1, finished_requests=[finished("r1", user="alice")]),
    )
    logger.record(None, None)
    logger.close()

    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 3
    first, second, third = lines
    assert first["model"] == "tiny-model"
    assert first["scheduler"]["num_running_reqs"] == 2
    assert first["scheduler"]["kv_cache_usage"] == 0.5
    assert first["iteration"]["num_prompt_tokens"] == 12
    assert first["finished_requests"] == []
    [request] = second["finished_requests"]
    assert request["request_id"] == "r1"
    assert request["finish_reason"] == "stop"
    assert request["extra"] == {"user": "alice"}
    assert third["scheduler"] is None and third["iteration"] is None


def test_appends_to_an_existing_file(tmp_path):
    path = tmp_path / "stats.jsonl"
    path.write_text('{"earlier": true}\n')
    logger = JsonlStatLogger(make_config(), path=str(path))
    logger.record(SchedulerStats(), IterationStats())
    logger.close()
    lines = path.read_text().splitlines()
    assert json.loads(lines[0]) == {"earlier": True}
    assert len(lines) == 2


def test_default_path_is_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.delenv(PATH_ENV_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    logger = JsonlStatLogger(make_config())
    logger.record(SchedulerStats(step_counter=4), None)
    logger.close()
    line = json.loads((tmp_path / "enginecore-stats.jsonl").read_text())
    assert line["scheduler"]["step_counter"] == 4


def test_the_installed_plugin_provides_jsonl():
    """The entry point is wired: "jsonl" is selectable like a built-in stat logger."""
    host = enginecore.make_plugin_manager()
    record = host.records["jsonl_stats"]
    assert record.loaded, record.error
    assert record.distribution == "enginecore-jsonl-stats"
    registry = host.registry("stat_logger")
    assert registry.entry("jsonl").plugin == "jsonl_stats"
    assert registry.get("jsonl") is JsonlStatLogger
