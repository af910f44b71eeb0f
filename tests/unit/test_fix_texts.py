"""Every metric a diagnosis or a doctor check names in its text is one that is exported.

An operator follows a fix text to Prometheus: a name that does not exist there (a counter
without its ``_total``, a renamed series) sends them to an empty query. The texts are read
from the source of ``otelkv/analysis/diagnose.py`` and ``doctor.py`` (every string literal,
f-string parts included), so texts that only some turns produce are covered too. The truth
is what the exporters expose: otelkv's metric table, as prometheus_client names its samples,
and the metric names in the installed vLLM's own source.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from otelkv import names

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "otelkv" / "analysis" / "diagnose.py", ROOT / "otelkv" / "analysis" / "doctor.py"]
METRIC_LIKE = re.compile(r"\b(otelkv_[a-z0-9_]*[a-z0-9]|vllm:[a-z0-9_:]*[a-z0-9])\b(?!\*)")
NOT_METRICS = {
    value
    for key, value in vars(names).items()
    if isinstance(value, str) and key.startswith(("CONFIG_", "XARG_"))
}
"""otelkv_* names that are configuration keys or body fields, not series."""


def _literals(path: Path) -> list[str]:
    return [
        node.value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]


def _mentioned() -> set[str]:
    found = set()
    for path in SOURCES:
        for text in _literals(path):
            found.update(m for m in METRIC_LIKE.findall(text) if m not in NOT_METRICS)
    return found


def _otelkv_exposed() -> set[str]:
    exposed = set()
    for spec in (*names.ENGINE_METRICS, *names.SIDECAR_METRICS):
        if spec.kind == names.COUNTER:
            exposed.add(f"{spec.name}_total")
        elif spec.kind == names.GAUGE:
            exposed.add(spec.name)
        else:  # a histogram is queried by its family name or one of its series
            exposed.update(spec.name + suffix for suffix in ("", "_bucket", "_sum", "_count"))
    return exposed


def test_the_scan_finds_the_names_the_texts_use() -> None:
    mentioned = _mentioned()
    assert "otelkv_kv_retention_block_seconds_total" in mentioned
    assert "vllm:num_requests_waiting" in mentioned
    assert not mentioned & NOT_METRICS


def test_every_otelkv_metric_in_a_fix_or_evidence_text_is_exported() -> None:
    wrong = sorted(m for m in _mentioned() if m.startswith("otelkv_") and m not in _otelkv_exposed())
    assert not wrong, f"named in diagnose.py/doctor.py but not exported: {wrong}"


def test_every_vllm_metric_in_a_fix_or_evidence_text_exists_in_the_installed_vllm() -> None:
    vllm = pytest.importorskip("vllm")
    root = Path(vllm.__file__).parent
    sources = "".join(
        p.read_text(errors="replace")
        for sub in ("v1/metrics", "distributed/kv_transfer/kv_connector/v1")
        for p in (root / sub).rglob("*.py")
    )
    for name in sorted(m for m in _mentioned() if m.startswith("vllm:")):
        family = name.removesuffix("_total")  # vLLM declares counters without the suffix
        assert f'"{family}"' in sources, f"{name} is not a metric of the installed vLLM"
