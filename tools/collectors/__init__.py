"""Offline checks for the OpenTelemetry Collector configs in ``collectors/``.

``python -m tools.collectors.validate FILE...`` checks collector configs against the
collector's pipeline rules and the key tables of the release they target
(:mod:`tools.collectors.components`), for machines without an ``otelcol-contrib`` binary.
It is no substitute for ``otelcol-contrib validate --config FILE`` where that runs.
"""
