"""The telemetry reference and the README stay true to ``otelkv.names``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from otelkv import names
from otelkv.analysis.diagnose import REGISTRY

ROOT = Path(__file__).resolve().parents[2]
TELEMETRY = (ROOT / "docs" / "telemetry.md").read_text()
README = (ROOT / "README.md").read_text()

ATTRIBUTE_KEYS = sorted(
    value
    for key, value in vars(names).items()
    if key.isupper()
    and isinstance(value, str)
    and (value.startswith("otelkv.") or value.startswith("gen_ai."))
    and not key.startswith(("SCOPE_", "CONFIG_", "ENV_", "PROVIDER_"))
)


@pytest.mark.parametrize("key", ATTRIBUTE_KEYS)
def test_every_attribute_key_is_documented(key: str) -> None:
    assert f"`{key}`" in TELEMETRY


METRICS = {m.name: m for m in names.ENGINE_METRICS}


@pytest.mark.parametrize("metric", sorted(METRICS))
def test_every_metric_is_documented_in_both_places(metric: str) -> None:
    kind = METRICS[metric].kind
    exposed = metric if kind != "counter" else f"{metric}_total"
    assert f"`{exposed}`" in TELEMETRY
    assert exposed in README


@pytest.mark.parametrize(
    "vocabulary",
    [names.PULL_REASONS, names.TRANSFER_OUTCOMES, names.RETENTION_OUTCOMES, names.REQUEST_OUTCOMES],
)
def test_every_vocabulary_value_is_documented(vocabulary: tuple[str, ...]) -> None:
    missing = [v for v in vocabulary if f"`{v}`" not in TELEMETRY]
    assert not missing


def test_readme_starts_with_the_two_commands() -> None:
    block = README.split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    assert [line.split()[0] for line in block] == ["./scripts/demo.sh", "./scripts/test.sh"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/test.sh" in ci


def test_diagnoses_doc_lists_exactly_the_registered_ids_in_catalogue_order() -> None:
    doc = (ROOT / "docs" / "diagnoses.md").read_text()
    documented = [line[3:].strip() for line in doc.splitlines() if line.startswith("## ")]
    assert documented == list(REGISTRY)
    declared = {v for k, v in vars(names).items() if k.startswith("DIAG_")}
    assert declared == set(REGISTRY)


def test_every_diagnosis_is_produced_by_real_engines_in_the_suite() -> None:
    """docs/diagnoses.md names, for every diagnosis in catalogue order, the real-fleet test
    modules (tests/fleet) where real engines produce it; each of them checks it by name."""
    doc = (ROOT / "docs" / "diagnoses.md").read_text()
    rows = re.findall(r"^\| `([a-z_]+)` \| [^|]+ \| ([^|]+) \|$", doc, re.MULTILINE)
    assert [diag for diag, _ in rows] == list(REGISTRY)
    constant = {getattr(names, n): n for n in dir(names) if n.startswith("DIAG_")}
    for diag, modules in rows:
        listed = re.findall(r"`(test_[a-z_]+)`", modules)
        assert listed, diag
        for module in listed:
            lines = (ROOT / "tests" / "fleet" / f"{module}.py").read_text().splitlines()
            # Named where it is expected, not only where it must be absent ("not in").
            used = [x for x in lines if f"names.{constant[diag]}" in x and "not in" not in x]
            assert used, (diag, module)
