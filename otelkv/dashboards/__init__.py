"""Grafana dashboards for otelkv, generated from code.

The dashboards are written with grafana-foundation-sdk (one function per panel), rendered to
sorted JSON with explicit panel ids and committed under ``dashboards/`` at the repository
root, so a review shows exactly what changed and ``otelkv dashboards build --check`` can
tell when the committed files lag behind the code.

Modules, one job each:

* :mod:`.sources`: the three datasources (Prometheus, the ClickHouse trace store, Tempo),
  their provisioned uids and the dashboard variables that pick them.
* :mod:`.promql` and :mod:`.sql`: query text built from :mod:`otelkv.names`, never re-typed
  metric names or attribute keys. :mod:`.sql` also holds the ClickHouse target (the SDK has
  no ClickHouse model).
* :mod:`.panels`: panel constructors with the units, thresholds and layout the dashboards share.
* :mod:`.agent_turns`, :mod:`.kv_reuse`, :mod:`.conversation`: one module per dashboard.
* :mod:`.build`: render, write and check the JSON; :mod:`.provisioning`: Grafana's
  provisioning files; :mod:`.push`: create or update everything on a Grafana server.
* :mod:`.inventory`: every query a dashboard sends, for the tests that run them against real
  data (after the expansion Grafana does, in ``tools/grafana_expand.py``).

Needs the ``dashboards`` extra (``pip install 'otelkv[dashboards]'``); nothing else in
otelkv imports this package.
"""
