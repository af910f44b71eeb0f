"""The sidecar: transparent proxy, OTLP receiver, store owner (see DESIGN.md, component 2).

Only the OTLP decoding exists so far; the proxy itself is the next milestone.
"""
