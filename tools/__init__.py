"""Developer tools outside the installed package: what only the tests and the README picture use.

* :mod:`tools.grafana_expand` - Grafana's and the ClickHouse plugin's variable expansion, so
  tests can run every dashboard query against real Prometheus and chDB.
* :mod:`tools.dashboard_picture` - the README's picture of the dashboards, drawn from a real run.
* :mod:`tools.grafana_style` - what Grafana does to a panel's numbers before drawing them (field
  config and overrides, colours, units, gaps), for that picture; :mod:`tools.panel_draw` draws
  each panel type with it.
* :mod:`tools.collectors` - offline validation of the collector configs in ``collectors/``
  (``python -m tools.collectors.validate FILE...`` from the repository root).
"""
