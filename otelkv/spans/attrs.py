"""Reading span attributes: one set of getters for in-memory spans and stored rows alike.

Spans built in memory carry native values; spans read back from ``otel_traces`` carry every
value as the string the OpenTelemetry Collector's ClickHouse exporter wrote
(``pcommon.Value.AsString()``: booleans ``true``/``false``, integers in decimal, doubles as
Go's ``strconv.FormatFloat(v, 'f', -1, 64)``, bytes base64, arrays and maps as JSON).
:func:`attr_value` renders a value that way (the store writes with it, so a row written by
otelkv and one written by a collector read identically); the ``attr_*`` getters accept both
forms and never raise; the ``opt_*`` getters tell "missing" (``None``) apart from a value,
which diagnoses need: an absent ``kv_transfer_params.returned`` is not the same evidence as
``false``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import Any, TypeVar

_T = TypeVar("_T")


def format_float(value: float) -> str:
    """Go's ``strconv.FormatFloat(v, 'f', -1, 64)``: shortest digits, fixed notation."""
    text = repr(value)
    if "e" in text:
        return format(Decimal(text).normalize(), "f")
    if text[-2:] == ".0":
        return text[:-2]
    if text[-1] in "nf":  # nan, inf, -inf
        return "NaN" if text == "nan" else "+Inf" if text == "inf" else "-Inf"
    return text


def _json_default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(bytes(value)).decode("ascii")
    return str(value)


def attr_value(value: Any) -> str:
    """One attribute value as the exporter stores it (``pcommon.Value.AsString``)."""
    t = type(value)
    if t is str:
        return value
    if t is bool:
        return "true" if value else "false"
    if t is int:
        return str(value)
    if t is float:
        return format_float(value)
    if value is None:
        return ""
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=_json_default)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, float):
        return format_float(float(value))
    return str(value)


def attr_map(attrs: Mapping[str, Any] | None) -> dict[str, str]:
    """An attribute dict as ``Map(String, String)`` content."""
    if not attrs:
        return {}
    out: dict[str, str] = {}
    for k, v in attrs.items():
        out[k if type(k) is str else str(k)] = v if type(v) is str else attr_value(v)
    return out


_TRUE = {"true", "1", "yes", "on", "t"}
_FALSE = {"false", "0", "no", "off", "f", ""}


def attr_str(attrs: Mapping[str, Any] | None, key: str, default: str = "") -> str:
    """A string attribute; non-strings rendered like the exporter (``True`` -> ``"true"``)."""
    if not attrs:
        return default
    value = attrs.get(key)
    if value is None:
        return default
    try:
        return value if isinstance(value, str) else attr_value(value)
    except Exception:  # noqa: BLE001 - a getter must never raise
        return default


def _coerce(attrs: Mapping[str, Any] | None, key: str, default: _T, convert: Callable[[Any], _T]) -> _T:
    """``convert(attrs[key])``, or ``default`` when the key is missing, None or not convertible.

    The one shape of the numeric getters: stored rows hold text, live spans native values,
    and a bad attribute must never raise out of an analysis.
    """
    value = attrs.get(key) if attrs else None
    if value is None:
        return default
    try:
        return convert(value)
    except (ValueError, TypeError, OverflowError):  # NaN/inf -> int raise too
        return default


def _to_int(value: Any) -> int:
    if isinstance(value, (int, float)):  # bool included: True -> 1
        return int(value)
    text = str(value).strip()
    try:
        return int(text)  # exact for big ints, which a float would round
    except ValueError:
        return int(float(text))


def _to_float(value: Any) -> float:
    return float(value if isinstance(value, (int, float)) else str(value).strip())


def attr_int(attrs: Mapping[str, Any] | None, key: str, default: int = 0) -> int:
    """An integer attribute from ``12``, ``"12"``, ``12.0`` or ``"12.0"``; bad/missing -> default."""
    return _coerce(attrs, key, default, _to_int)


def attr_float(attrs: Mapping[str, Any] | None, key: str, default: float = 0.0) -> float:
    """A float attribute from ``1.5`` or ``"1.5"`` (also ``"NaN"``/``"+Inf"``); bad/missing -> default."""
    return _coerce(attrs, key, default, _to_float)


def attr_bool(attrs: Mapping[str, Any] | None, key: str, default: bool = False) -> bool:
    """A boolean attribute from ``True`` or ``"true"``/``"false"`` (also 1/0); else default."""
    value = attrs.get(key) if attrs else None
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE and text != "":
            return False
    return default


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
