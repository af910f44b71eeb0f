"""Attribute getters that accept native values (in-memory spans) and stored strings.

Spans read back from the store carry every attribute value as a string (``"12"``,
``"true"``); spans built in memory carry native types. The analysis must treat both the
same, so every read goes through these getters. The plain getters come from
:mod:`otelkv.store.rows` (one definition of the stored format); the ``opt_*`` variants
tell "missing" (``None``) apart from a value, which diagnoses need: an absent
``kv_transfer_params.returned`` is not the same evidence as ``false``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from otelkv.store.rows import attr_bool, attr_float, attr_int, attr_str

__all__ = ["attr_bool", "attr_float", "attr_int", "attr_str", "opt_bool", "opt_float", "opt_int", "opt_str"]

_Attrs = Mapping[str, Any] | None


def _present(attrs: _Attrs, key: str) -> bool:
    if not attrs:
        return False
    value = attrs.get(key)
    return value is not None and not (isinstance(value, str) and value.strip() == "")


def opt_str(attrs: _Attrs, key: str) -> str | None:
    """The attribute as a string, or None when absent or empty."""
    return attr_str(attrs, key) if _present(attrs, key) else None


def opt_int(attrs: _Attrs, key: str) -> int | None:
    """The attribute as an int, or None when absent or unreadable."""
    if not _present(attrs, key):
        return None
    marker = -(2**63) + 7
    value = attr_int(attrs, key, marker)
    return None if value == marker else value


def opt_float(attrs: _Attrs, key: str) -> float | None:
    """The attribute as a float, or None when absent or unreadable."""
    if not _present(attrs, key):
        return None
    value = attr_float(attrs, key, float("nan"))
    return None if value != value else value  # NaN: unreadable


def opt_bool(attrs: _Attrs, key: str) -> bool | None:
    """The attribute as a bool, or None when absent or not a boolean."""
    if not _present(attrs, key):
        return None
    if attr_bool(attrs, key, True) is attr_bool(attrs, key, False):
        return attr_bool(attrs, key, False)
    return None
