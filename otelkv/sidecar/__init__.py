"""The sidecar: transparent proxy, OTLP receiver, store owner (see DESIGN.md, component 2).

Layout: relay.py + turn_watch.py + proxy_worker.py run in the proxy process; the rest
(recorder, pipeline, receiver, api, metrics) in the main process, wired in app.py.
"""
