"""Engine-side instrumentation: code that runs inside vLLM's processes.

Only the OpenTelemetry API/SDK and vLLM itself are imported from here.
``connector`` is the delegating facade; ``scheduler_observer`` (EngineCore) and
``worker_observer`` (workers) hold the role-specific work; ``nixl`` is the NIXL preset.
"""
