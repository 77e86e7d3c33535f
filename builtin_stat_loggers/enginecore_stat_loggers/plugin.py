"""Registers the built-in stat loggers through the same hook third-party plugins use."""

from __future__ import annotations

from typing import Any

from enginecore.hookspecs import hookimpl
from enginecore.registry import Registry


@hookimpl(trylast=True)
def register_stat_loggers(registry: Registry[Any]) -> None:
    # Lazy references: prometheus-client is imported only when "prometheus" is selected.
    registry.add(
        "logging",
        "enginecore_stat_loggers.logging_logger:LoggingStatLogger",
        summary="periodic log line: throughput, queue sizes, KV cache usage, prefix hit rate",
    )
    registry.add(
        "prometheus",
        "enginecore_stat_loggers.prometheus_logger:PrometheusStatLogger",
        summary="Prometheus gauges, counters and histograms under the 'enginecore:' prefix",
    )
