"""The sidecar: transparent proxy in front of the router, OTLP receiver, store owner, query API.

Layout: relay.py + turn_watch.py + proxy_worker.py run in the proxy process; the rest
(recorder, pipeline, receiver, api, metrics) in the main process, wired in app.py.
"""
