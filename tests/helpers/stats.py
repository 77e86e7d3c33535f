"""Stat-logger test tools: a fake clock, Prometheus exposition and samples, per-engine counters."""

from __future__ import annotations

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def exposition(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(exposition(registry)):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise AssertionError(f"no sample {name} {labels} in:\n{exposition(registry)}")


def generation_tokens_by_engine(url: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == "enginecore:generation_tokens_total":
                values[sample.labels["engine"]] = sample.value
    return values
