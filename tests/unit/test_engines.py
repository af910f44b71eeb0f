"""Ports for the reference fleet's engines (``otelkv.fleet.engines.free_port``)."""

from __future__ import annotations

import socket
from pathlib import Path

from otelkv.fleet.engines import LOWEST_PORT, ephemeral_port_range, free_port


def test_free_ports_are_outside_the_ephemeral_range_distinct_and_free(tmp_path: Path) -> None:
    low, high = ephemeral_port_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(LOWEST_PORT <= p < low for p in ports), (low, high, ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # still free to bind
    (tmp_path / "range").write_text("1024\t60999\n")
    assert ephemeral_port_range(str(tmp_path / "range")) == (1024, 60999)
    assert ephemeral_port_range(str(tmp_path / "missing")) == (32768, 60999)
