"""The built-in stat loggers pass the conformance kit's StatLoggerContract."""

from __future__ import annotations

from enginecore.testing import StatLoggerContract


class TestLoggingStatLoggerContract(StatLoggerContract):
    stat_logger = "logging"


class TestPrometheusStatLoggerContract(StatLoggerContract):
    stat_logger = "prometheus"

    def make_logger(self, engine_index: int = 0):
        from prometheus_client import CollectorRegistry

        cls = self.logger_class()
        # One registry per logger pair would collide on metric names; each test gets its own.
        if not hasattr(self, "_registry"):
            self._registry = CollectorRegistry()
        return cls(self.make_config(), engine_index, registry=self._registry)
