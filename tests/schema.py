"""Validating otelkv's JSON answers against the schema file the package ships."""

from __future__ import annotations

from typing import Any

from jsonschema import Draft202012Validator

from otelkv.analysis import turn_json

_VALIDATOR = Draft202012Validator(turn_json.schema(), format_checker=Draft202012Validator.FORMAT_CHECKER)


def assert_valid(document: dict[str, Any]) -> dict[str, Any]:
    """The document, after checking it against ``turn.schema.json`` (every error listed)."""
    errors = sorted(_VALIDATOR.iter_errors(document), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors[:20])
    return document
