"""What an engine's ``/metrics`` shows for a stats payload, read back from the text exposition.

The scheduler observer hands vLLM a payload per step; vLLM gives it to the connector's
Prometheus metrics in the API server, which ``/metrics`` exposes. Tests of the observer
assert on that exposition (metric names and labels as scraped), not on the payload's own
encoding, so a change of encoding cannot hide a wrong count.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from otelkv.engine.prom import OtelKVPromMetrics
from tests.unit.test_prom import metric_types

VLLM_LABELS = {"model_name": "tiny", "engine": "0"}


class Exposition:
    """Samples of one scrape: ``value("otelkv_requests_total", role="prefill", outcome=...)``."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples = [
            (s.name, dict(s.labels), s.value)
            for family in text_string_to_metric_families(text)
            for s in family.samples
        ]

    def value(self, name: str, **labels: str) -> float | None:
        want = {**VLLM_LABELS, **labels}
        found = [v for n, lab, v in self.samples if n == name and lab == want]
        return found[0] if found else None

    def total(self, name: str) -> float:
        """The sum of every sample of ``name``: 0 when nothing was counted (label sets are
        exposed at 0 from the start, so absence is no longer how "not counted" shows)."""
        return sum(v for n, _, v in self.samples if n == name)

    def names(self) -> set[str]:
        """Every sample name scraped, zero or not."""
        return {n for n, _, _ in self.samples}


def exposed(payload: dict[str, Any]) -> Exposition:
    """The exposition after vLLM's stat loop observed ``payload`` once."""
    registry = CollectorRegistry()
    metrics = OtelKVPromMetrics(
        SimpleNamespace(kv_transfer_config=None),
        metric_types(registry),
        list(VLLM_LABELS),
        {0: list(VLLM_LABELS.values())},
        None,
    )
    metrics.observe({"otelkv": payload}, 0)
    return Exposition(generate_latest(registry).decode())
