"""The reference fleet: real vLLM prefill/decode engines, a P/D router, an agent driver.

Used by the demo, the tests and the benchmarks. Needs the ``cpu`` (or ``gpu``) and
``fleet`` extras.
"""
