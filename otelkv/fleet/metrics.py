"""Read a Prometheus text exposition (an engine's /metrics) into plain numbers."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families


def parse_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """All samples as (sample name, labels, value), e.g. ``otelkv_requests_total``."""
    out: list[tuple[str, dict[str, str], float]] = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.append((sample.name, dict(sample.labels), float(sample.value)))
    return out


def total(text: str, name: str, where: Mapping[str, str] | None = None) -> float:
    """Sum of a sample's values over all series whose labels match ``where``."""
    where = where or {}
    return sum(
        value
        for sample, labels, value in parse_samples(text)
        if sample == name and all(labels.get(k) == v for k, v in where.items())
    )


def by_label(text: str, name: str, label: str) -> dict[str, float]:
    """Sum of a sample's values grouped by one label, for the values that counted something:
    otelkv exposes every known label set at 0 from the start, and a group still at 0 is left
    out, so the answer is what happened."""
    out: dict[str, float] = {}
    for sample, labels, value in parse_samples(text):
        if sample == name and label in labels:
            out[labels[label]] = out.get(labels[label], 0.0) + value
    return {key: value for key, value in out.items() if value}
