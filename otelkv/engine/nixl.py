"""NIXL preset: the instrumented connector wrapping vLLM's ``NixlConnector``.

Load it by pointing ``kv_connector_module_path`` here and keeping the connector name::

    --kv-transfer-config '{"kv_connector": "NixlConnector",
        "kv_connector_module_path": "otelkv.engine.nixl",
        "kv_role": "kv_producer", ... , "kv_connector_extra_config": {...}}'

vLLM imports this module and takes its ``NixlConnector`` attribute, so the name-based
checks vLLM makes (``kv_transfer_config.has_connector("NixlConnector")``) stay true and
every NIXL setting in ``kv_connector_extra_config`` keeps its meaning.
"""

from __future__ import annotations

from otelkv.engine.connector import OtelKVConnector


class NixlConnector(OtelKVConnector):
    """vLLM's NixlConnector (pull mode), instrumented by otelkv."""

    _otelkv_inner_name = "NixlConnector"


__all__ = ["NixlConnector"]
