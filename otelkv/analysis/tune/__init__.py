"""``otelkv tune``: what another decode TTL, recompute threshold or router TTL would have done.

One job per module:

* :mod:`.fit` - cost models fitted from the recorded spans (recompute seconds per token
  from prefill compute, pull seconds as fixed + per byte from ``kv_transfer`` spans).
* :mod:`.evidence` - the gate every recommendation and fitted-cost flag passes first
  (sample counts, r², residual, slope, size range); "not enough evidence" otherwise.
* :mod:`.config` - the settings that were in force (engine resources, router spans).
* :mod:`.replay` - the recorded hand-offs (decode end -> next prefill) replayed under a
  candidate setting, deciding pull or recompute the way vLLM 0.32.0 does.
* :mod:`.recommend` - the values to use (when the evidence holds) and the settings that are
  clearly wrong.
* :mod:`.window` - the whole answer for a window of a span source, as a JSON-able dict.
"""
