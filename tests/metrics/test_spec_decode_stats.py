"""Speculative-decoding stats in the logging line and in Prometheus."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry

from enginecore import make_config
from enginecore.interfaces import IterationStats
from enginecore.protocol import SchedulerStats
from enginecore_stat_loggers.logging_logger import LoggingStatLogger
from enginecore_stat_loggers.prometheus_logger import PrometheusStatLogger
from tests.helpers.stats import FakeClock, exposition, sample

SPEC = dict(speculative_method="ngram", num_speculative_tokens=4)


def step_stats(drafts: int, draft_tokens: int, accepted: int) -> SchedulerStats:
    return SchedulerStats(
        num_running_reqs=2,
        spec_num_drafts=drafts,
        spec_num_draft_tokens=draft_tokens,
        spec_num_accepted_tokens=accepted,
    )


def test_logging_line_reports_acceptance_rate_and_mean_accepted_length(caplog):
    clock = FakeClock()
    logger = LoggingStatLogger(make_config(model="tiny", **SPEC), 0, clock=clock)
    caplog.set_level(logging.INFO, logger="enginecore.metrics")
    logger.record(step_stats(2, 8, 5), IterationStats(num_generation_tokens=7))
    logger.record(step_stats(2, 8, 3), IterationStats(num_generation_tokens=5))
    clock.now += 1.0
    logger.log()
    # 8 accepted of 16 verified; 4 verifying steps: 1 + 8 / 4 tokens each.
    assert (
        caplog.records[-1]
        .getMessage()
        .endswith(", Spec decode: draft acceptance rate: 50.0%, mean accepted length: 3.00")
    )
    logger.record(step_stats(0, 0, 0), IterationStats(num_generation_tokens=1))
    clock.now += 1.0
    logger.log()  # an interval without drafts adds nothing (no division by zero)
    assert "Spec decode" not in caplog.records[-1].getMessage()


def test_prometheus_counters():
    registry = CollectorRegistry()
    logger = PrometheusStatLogger(make_config(model="tiny", **SPEC), 0, registry=registry)
    labels = dict(engine="0", model_name="tiny")
    assert sample(registry, "enginecore:spec_decode_num_drafts_total", **labels) == 0
    logger.record(step_stats(2, 8, 5), None)
    logger.record(step_stats(1, 4, 4), None)
    assert sample(registry, "enginecore:spec_decode_num_drafts_total", **labels) == 3
    assert sample(registry, "enginecore:spec_decode_num_draft_tokens_total", **labels) == 12
    assert sample(registry, "enginecore:spec_decode_num_accepted_tokens_total", **labels) == 9
    per_pos = "enginecore:spec_decode_num_accepted_tokens_per_pos_total"
    assert sample(registry, per_pos, position="3", **labels) == 0  # created for each slot
    logger.record(SchedulerStats(spec_num_drafts=2, spec_num_accepted_tokens_per_pos=[2, 1]), None)
    assert sample(registry, per_pos, position="0", **labels) == 2
    assert sample(registry, per_pos, position="1", **labels) == 1
    # Without speculation the series are not exported.
    plain = CollectorRegistry()
    PrometheusStatLogger(make_config(model="tiny"), 0, registry=plain)
    assert "spec_decode_num_drafts_total{" not in exposition(plain)
