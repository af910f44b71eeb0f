"""What ``otelkv compare`` shows of :mod:`otelkv.analysis.compare`'s numbers.

* :mod:`.text` - the terminal summary.
* :mod:`.svg` and :mod:`.html` - one self-contained HTML file with hand-written SVG charts.
"""
