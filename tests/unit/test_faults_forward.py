"""The collector named by ``OTEL_EXPORTER_OTLP_*`` is down or hangs: nothing else notices.

A real ``otelkv sidecar`` forwards its turn spans to a local endpoint that refuses
connections (down) or accepts them and never answers (slow). Requests must go on byte
for byte, the store must still get every turn, what never reached the collector must be
counted (``otelkv_sidecar_forward_dropped_total``), memory must stay bounded, and a stop
must not wait for the collector (it used to take ~17 s, while agents were refused).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from otelkv import names
from otelkv.sidecar.forward import SHUTDOWN_TIMEOUT_S
from tests.unit import sidecar_harness as h

QUEUE_SPANS = 100
"""OTEL_BSP_MAX_QUEUE_SIZE for the test: small, so a few hundred turns overflow it."""
TURNS = 400
MAIN_GROWTH_MB = 150.0
PROXY_GROWTH_MB = 20.0
STOP_S = SHUTDOWN_TIMEOUT_S + 6.0
"""A stop may take the forwarder's bound plus a normal stop (proxy, writer, store)."""


@contextlib.contextmanager
def collector(kind: str) -> Iterator[str]:
    """A traces endpoint that is ``down`` (nothing listens) or ``slow`` (accepts, never answers)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{server.getsockname()[1]}/v1/traces"
    if kind == "down":
        server.close()
        yield url
        return
    server.listen(64)
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield url
    finally:
        server.close()
        for conn in held:
            conn.close()


@pytest.mark.parametrize("kind", ["down", "slow"])
def test_collector_down_or_slow_costs_no_request_and_no_stored_span(
    kind: str, fake_upstream: str, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    with collector(kind) as endpoint:
        env = {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint,
            "OTEL_EXPORTER_OTLP_TIMEOUT": "1",
            "OTEL_BSP_MAX_QUEUE_SIZE": str(QUEUE_SPANS),
            "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "50",
            "OTEL_BSP_SCHEDULE_DELAY": "50",
        }
        sc = h.start_cli(fake_upstream, store, env)
        try:
            baseline = {name: h.RssSampler({name: pid}) for name, pid in sc.pids.items()}
            for sampler in baseline.values():
                sampler.sample()
            with h.RssSampler(sc.pids) as rss:
                results = h.run_turns(sc.proxy_url, f"fwd-{kind}", TURNS // 4, 4)
                assert not h.failures(results), h.failures(results)[:3]
                time.sleep(1.5)  # let exports time out and fail
            text = sc.metrics()
            dropped = h.metric(text, names.METRIC_SIDECAR_FORWARD_DROPPED + "_total")
            assert dropped > 0, "spans that never reached the collector were not counted"
            # A hanging collector holds each export for its timeout, so the small queue must
            # overflow; a refused connection fails each export at once, and whether the queue
            # also overflows depends on how fast the turns come: only the failures are certain.
            reason = "queue_full" if kind == "slow" else "export_failed"
            assert h.metric(text, names.METRIC_SIDECAR_FORWARD_DROPPED + "_total", reason=reason) > 0
            for name, sampler in baseline.items():
                bound = MAIN_GROWTH_MB if name == "main" else PROXY_GROWTH_MB
                assert rss.peak(name) < sampler.samples[name][0][1] + bound, rss.summary(name)
            started = time.monotonic()
        finally:
            code = sc.stop()
        assert time.monotonic() - started < STOP_S
        assert code == 0
    # The store does not depend on the collector: every turn is there.
    stored = h.stored_conversations(store)
    assert sum(n for c, n in stored.items() if c.startswith(f"fwd-{kind}")) == TURNS
