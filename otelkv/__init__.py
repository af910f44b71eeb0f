"""otelkv: one OpenTelemetry trace per agent turn across a disaggregated vLLM fleet."""

__version__ = "0.1.0"
