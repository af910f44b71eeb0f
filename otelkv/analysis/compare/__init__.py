"""``otelkv compare A B``: two recorded runs of the same workload, side by side.

One job per module:

* :mod:`.rows` - a run (store directory or ClickHouse) read into one plain row per turn:
  TTFT, prompt length, prefill compute and KV-transfer seconds, pull reason, retention,
  diagnoses. chDB opens one directory per process at a time, so run A is read and closed
  before run B is opened; rows are plain data for that reason.
* :mod:`.aggregate` - turns matched across runs by (conversation id, turn index), and the
  numbers of the report: TTFT quantiles by turn index and by prompt length, prefill split,
  pulls by reason, retained memory, regressed turns, the settings that differ.

The terminal summary and the HTML report that show these numbers are the CLI's
(:mod:`otelkv.cli.compare_report`).
"""
