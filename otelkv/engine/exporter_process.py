"""The engine's exporter process: marshalled span batches in on stdin, OTLP out.

``python -m otelkv.engine.exporter_process``, started once per engine by
:class:`otelkv.engine.span_export.ProcessWriter`. It builds the SDK spans and exports them
with the standard OTLP exporter and the same ``OTEL_*`` settings as the engine, so the
engine's own process never spends its CPU on encoding. It exits with its parent.
"""

from __future__ import annotations

import logging
import marshal
import sys
from typing import Any

from otelkv.engine import telemetry
from otelkv.engine.span_export import FinishedSpan, build_spans

logger = logging.getLogger("vllm.otelkv")


def _read_exact(stream: Any, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _die_with_parent() -> None:
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main() -> int:
    """Exporter process: read marshalled batches from stdin, export them over OTLP."""
    _die_with_parent()
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    from otelkv import __version__

    stream = sys.stdin.buffer
    exporter = None
    resource = Resource.create({})
    scope = InstrumentationScope("otelkv.engine", __version__)
    while True:
        header = _read_exact(stream, 4)
        if header is None:
            break
        payload = _read_exact(stream, int.from_bytes(header, "big"))
        if payload is None:
            break
        kind, body = marshal.loads(payload)
        if kind == "resource":
            resource = Resource.create(body)
            try:
                exporter = telemetry.make_exporter()
            except Exception:
                logger.exception("otelkv: cannot create the OTLP span exporter; spans are dropped")
            continue
        if exporter is not None:
            try:
                exporter.export(build_spans([FinishedSpan(*r) for r in body], resource, scope))
            except Exception:
                logger.warning("otelkv: exporting a batch of spans failed", exc_info=True)
    if exporter is not None:
        exporter.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
