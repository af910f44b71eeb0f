"""What otelcol-contrib 0.162.0 accepts, for the components ``collectors/`` uses.

Transcribed by hand from the upstream ``config.schema.yaml`` files named above each table
(open-telemetry/opentelemetry-collector for core components, -contrib for the rest), as
found on the upstream main branch of the 0.15x-0.16x releases (2026), and from the
components' READMEs; not re-read from the v0.162.0 tag itself. The schemas use
cross-package ``$ref``s that a JSON-schema library cannot follow as they are.
Only components used in ``collectors/`` are listed: a config that uses another one is
reported, not waved through. Update the tables together with :data:`COLLECTOR_VERSION`.
"""

from __future__ import annotations

import re
from typing import Any

COLLECTOR_VERSION = "0.162.0"
"""The otelcol-contrib release these tables describe (and collectors/compose.yaml pins)."""

# --------------------------------------------------------------------------------------
# A spec maps a key to a value type, a nested spec (dict) or a list of objects ([spec]).
# Types: str, int, float, bool, duration, str[], duration[], map (free-form), any, empty
# ({} or nothing), policies / policy (tail-sampling policies, checked per type).
# --------------------------------------------------------------------------------------

Spec = dict[str, Any]

# core config/configtls (client_config, server_config)
TLS_COMMON: Spec = {
    "ca_file": "str", "ca_pem": "str", "cert_file": "str", "cert_pem": "str", "key_file": "str",
    "key_pem": "str", "min_version": "str", "max_version": "str", "cipher_suites": "str[]",
    "reload_interval": "duration", "include_system_ca_certs_pool": "bool", "curve_preferences": "str[]",
}  # fmt: skip
TLS_CLIENT: Spec = {
    **TLS_COMMON,
    "insecure": "bool",
    "insecure_skip_verify": "bool",
    "server_name_override": "str",
}
TLS_SERVER: Spec = {**TLS_COMMON, "client_ca_file": "str", "client_ca_file_reload": "bool"}

# core config/configgrpc config.schema.yaml: server_config (+ confignet.addr_config), client_config
GRPC_SERVER: Spec = {
    "endpoint": "str", "transport": "str", "dialer": "map", "tls": TLS_SERVER, "auth": "map",
    "include_metadata": "bool", "keepalive": "map", "max_concurrent_streams": "int",
    "max_recv_msg_size_mib": "int", "middlewares": "any", "read_buffer_size": "int",
    "write_buffer_size": "int",
}  # fmt: skip
GRPC_CLIENT: Spec = {
    "endpoint": "str", "auth": "map", "authority": "str", "balancer_name": "str", "compression": "str",
    "headers": "map", "middlewares": "any",
    "keepalive": {"permit_without_stream": "bool", "time": "duration", "timeout": "duration"},
    "read_buffer_size": "int", "tls": TLS_CLIENT, "wait_for_ready": "bool", "write_buffer_size": "int",
}  # fmt: skip

# core config/confighttp config.schema.yaml: server_config
HTTP_SERVER: Spec = {
    "endpoint": "str", "auth": "map", "compression_algorithms": "str[]",
    "cors": {"allowed_headers": "str[]", "allowed_origins": "str[]", "max_age": "int"},
    "idle_timeout": "duration", "include_metadata": "bool", "keep_alives_enabled": "bool",
    "max_request_body_size": "int", "middlewares": "any", "read_header_timeout": "duration",
    "read_timeout": "duration", "response_headers": "map", "tls": TLS_SERVER, "write_timeout": "duration",
}  # fmt: skip

# core config/configretry back_off_config; exporter/exporterhelper timeout and queue_batch_config
RETRY: Spec = {
    "enabled": "bool", "initial_interval": "duration", "max_interval": "duration",
    "max_elapsed_time": "duration", "multiplier": "float", "randomization_factor": "float",
}  # fmt: skip
QUEUE: Spec = {
    "enabled": "bool", "num_consumers": "int", "queue_size": "int", "block_on_overflow": "bool",
    "sizer": "str", "storage": "str", "wait_for_result": "bool", "batch": "map",
}  # fmt: skip
EXPORTER_HELPER: Spec = {"timeout": "duration", "retry_on_failure": RETRY, "sending_queue": QUEUE}

# core exporter/otlpexporter (type otlp_grpc since core v0.144.0)
OTLP_GRPC_EXPORTER: Spec = {**GRPC_CLIENT, **EXPORTER_HELPER}

RECEIVERS: dict[str, Spec] = {
    # core receiver/otlpreceiver/config.schema.yaml
    "otlp": {
        "protocols": {
            "grpc": GRPC_SERVER,
            "http": {
                **HTTP_SERVER,
                "traces_url_path": "str",
                "metrics_url_path": "str",
                "logs_url_path": "str",
            },
        }
    },
}

TAIL_SAMPLING_POLICY_SUBKEYS: dict[str, Spec] = {
    # contrib processor/tailsamplingprocessor/config.schema.yaml ($defs *_cfg) and README
    "always_sample": {},
    "latency": {"threshold_ms": "int", "upper_threshold_ms": "int"},
    "numeric_attribute": {"key": "str", "min_value": "int", "max_value": "int", "invert_match": "bool"},
    "probabilistic": {"hash_salt": "str", "sampling_percentage": "float"},
    "status_code": {"status_codes": "str[]"},
    "string_attribute": {
        "key": "str", "values": "str[]", "enabled_regex_matching": "bool", "cache_max_size": "int",
        "invert_match": "bool",
    },
    "rate_limiting": {"spans_per_second": "int"},
    "bytes_limiting": {"bytes_per_second": "int", "burst_capacity": "int"},
    "span_count": {"min_spans": "int", "max_spans": "int"},
    "trace_state": {"key": "str", "values": "str[]"},
    "boolean_attribute": {"key": "str", "value": "bool", "invert_match": "bool"},
    "ottl_condition": {"error_mode": "str", "span": "str[]", "spanevent": "str[]"},
    "and": {"and_sub_policy": "policies"},
    "drop": {"drop_sub_policy": "policies"},
    "not": {"not_sub_policy": "policy"},
    "composite": {
        "max_total_spans_per_second": "int", "policy_order": "str[]", "composite_sub_policy": "policies",
        "rate_allocation": [{"policy": "str", "percent": "int"}],
    },
}  # fmt: skip
STATUS_CODES = {"OK", "ERROR", "UNSET"}
OTTL_ERROR_MODES = {"ignore", "silent", "propagate"}

PROCESSORS: dict[str, Spec] = {
    # core internal/memorylimiter/config.schema.yaml
    "memory_limiter": {
        "check_interval": "duration", "limit_mib": "int", "limit_percentage": "int",
        "spike_limit_mib": "int", "spike_limit_percentage": "int",
        "min_gc_interval_when_hard_limited": "duration", "min_gc_interval_when_soft_limited": "duration",
    },
    # core processor/batchprocessor/config.schema.yaml
    "batch": {
        "send_batch_size": "int", "send_batch_max_size": "int", "timeout": "duration",
        "metadata_keys": "str[]", "metadata_cardinality_limit": "int",
    },
    # contrib processor/tailsamplingprocessor/config.schema.yaml (policies checked per type)
    "tail_sampling": {
        "decision_wait": "duration", "decision_wait_after_root_received": "duration", "num_traces": "int",
        "expected_new_traces_per_sec": "int", "sample_on_first_match": "bool", "block_on_overflow": "bool",
        "drop_pending_traces_on_shutdown": "bool", "maximum_trace_size_bytes": "int",
        "decision_cache": {"sampled_cache_size": "int", "non_sampled_cache_size": "int"},
        "policies": "policies",
    },
    # contrib processor/resourcedetectionprocessor/config.schema.yaml (type resource_detection
    # since contrib PR #48525); per-detector sections other than system are free-form here
    "resource_detection": {
        "detectors": "str[]", "override": "bool", "refresh_interval": "duration", "timeout": "duration",
        "system": {"hostname_sources": "str[]", "resource_attributes": "map"},
        **{d: "map" for d in ("ec2", "ecs", "eks", "gcp", "azure", "aks", "docker", "k8snode")},
        **{d: "map" for d in ("kubeadm", "openshift", "consul", "heroku", "lambda")},
    },
}  # fmt: skip
RESOURCE_DETECTORS = {
    "env", "system", "docker", "ec2", "ecs", "eks", "elasticbeanstalk", "lambda", "gcp", "azure", "aks",
    "consul", "heroku", "k8snode", "kubeadm", "openshift", "akamai", "alibaba_ecs", "digitalocean",
    "hetzner", "nova", "oraclecloud", "scaleway", "upcloud", "vultr",
}  # fmt: skip

DIMENSION: Spec = {"name": "str", "default": "str"}
CONNECTORS: dict[str, Spec | str] = {
    # core connector/forwardconnector: no settings
    "forward": "empty",
    # contrib connector/spanmetricsconnector/config.schema.yaml (type span_metrics since contrib PR #47963)
    "span_metrics": {
        "namespace": "str", "dimensions": [DIMENSION], "calls_dimensions": [DIMENSION],
        "exclude_dimensions": "str[]", "add_resource_attributes": "bool",
        "aggregation_cardinality_limit": "int", "aggregation_temporality": "str",
        "dimensions_cache_size": "int", "include_instrumentation_scope": "str[]",
        "metric_timestamp_cache_size": "int", "metrics_expiration": "duration",
        "metrics_flush_interval": "duration", "resource_metrics_cache_size": "int",
        "resource_metrics_key_attributes": "str[]",
        "events": {"enabled": "bool", "dimensions": [DIMENSION]},
        "exemplars": {"enabled": "bool", "max_per_data_point": "int"},
        "histogram": {
            "disable": "bool", "unit": "str", "dimensions": [DIMENSION],
            "explicit": {"buckets": "duration[]"}, "exponential": {"max_size": "int"},
        },
    },
    # contrib connector/servicegraphconnector/config.schema.yaml
    "servicegraph": {
        "cache_loop": "duration", "database_name_attributes": "str[]", "dimensions": "str[]",
        "exponential_histogram_max_size": "int", "latency_histogram_buckets": "duration[]",
        "metrics_flush_interval": "duration", "metrics_timestamp_offset": "duration",
        "store": {"max_items": "int", "ttl": "duration"}, "store_expiration_loop": "duration",
        "virtual_node_extra_label": "bool", "virtual_node_peer_attributes": "str[]",
    },
}  # fmt: skip
AGGREGATION_TEMPORALITIES = {"AGGREGATION_TEMPORALITY_CUMULATIVE", "AGGREGATION_TEMPORALITY_DELTA"}

EXPORTERS: dict[str, Spec] = {
    # contrib exporter/clickhouseexporter/config.schema.yaml
    "clickhouse": {
        "endpoint": "str", "username": "str", "password": "str", "database": "str",
        "traces_table_name": "str", "logs_table_name": "str", "metrics_table_name": "str",
        "metrics_tables": "map", "create_schema": "bool", "ttl": "duration", "async_insert": "bool",
        "compress": "str", "connection_params": "map", "cluster_name": "str",
        "table_engine": {"name": "str", "params": "str"}, "tls": TLS_CLIENT, **EXPORTER_HELPER,
    },
    "otlp_grpc": OTLP_GRPC_EXPORTER,
    # contrib exporter/prometheusexporter/config.schema.yaml (+ confighttp server_config)
    "prometheus": {
        **HTTP_SERVER, "namespace": "str", "const_labels": "map", "send_timestamps": "bool",
        "metric_expiration": "duration", "enable_open_metrics": "bool", "add_metric_suffixes": "bool",
        "translation_strategy": "str", "without_scope_info": "bool",
        "resource_to_telemetry_conversion": {"enabled": "bool"}, "sending_queue": QUEUE,
    },
    # contrib exporter/loadbalancingexporter/config.schema.yaml (type load_balancing since contrib PR #48533)
    "load_balancing": {
        "routing_key": "str", "routing_attributes": "str[]", "protocol": {"otlp": OTLP_GRPC_EXPORTER},
        "resolver": {
            "static": {"hostnames": "str[]"},
            "dns": {"hostname": "str", "port": "str", "interval": "duration", "timeout": "duration"},
            "k8s": {"service": "str", "ports": "any", "timeout": "duration", "return_hostnames": "bool"},
            "aws_cloud_map": "map",
        },
        **EXPORTER_HELPER,
    },
}  # fmt: skip
ROUTING_KEYS = {"traceID", "service", "resource", "metric", "streamID", "attributes"}

EXTENSIONS: dict[str, Spec] = {
    # contrib extension/healthcheckextension
    "health_check": {**HTTP_SERVER, "path": "str", "response_body": "map", "check_collector_pipeline": "map"},
}

SIGNALS = ("traces", "metrics", "logs")
RECEIVER_SIGNALS = {"otlp": set(SIGNALS)}
PROCESSOR_SIGNALS = {
    "memory_limiter": set(SIGNALS),
    "batch": set(SIGNALS),
    "resource_detection": set(SIGNALS),
    "tail_sampling": {"traces"},
}
EXPORTER_SIGNALS = {
    "clickhouse": set(SIGNALS),
    "otlp_grpc": set(SIGNALS),
    "load_balancing": set(SIGNALS),
    "prometheus": {"metrics"},
}
CONNECTOR_PAIRS = {
    "forward": {(s, s) for s in SIGNALS},
    "span_metrics": {("traces", "metrics")},
    "servicegraph": {("traces", "metrics")},
}
"""(signal of the pipeline it exports from, signal of the pipeline it receives into)."""

SERVICE_KEYS = {"extensions", "pipelines", "telemetry"}
TELEMETRY_KEYS = {"logs", "metrics", "traces", "resource"}
PIPELINE_KEYS = {"receivers", "processors", "exporters"}
PIPELINE_ID = re.compile(r"^(traces|metrics|logs)(/[^/\s]+)?$")
GO_DURATION = re.compile(r"^(0|([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+)$")

# pkg/ottl/contexts/ottlspan: the span-context paths the tail_sampling ottl_condition policy
# evaluates (unprefixed form, as in the processor's README examples)
OTTL_SPAN_PATHS = {
    "name", "kind", "status.code", "status.message", "trace_id.string", "span_id.string",
    "parent_span_id.string", "start_time_unix_nano", "end_time_unix_nano",
    "instrumentation_scope.name", "instrumentation_scope.version",
}  # fmt: skip
OTTL_SPAN_MAP_PATHS = {"attributes", "resource.attributes", "instrumentation_scope.attributes"}
