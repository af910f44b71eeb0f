"""Comparing a measured wall-clock interval with the time a test slept."""

from __future__ import annotations

SLEW = 1e-3
"""Span timestamps and the kernel's packet timestamps are ``CLOCK_REALTIME``, which NTP may
slew by up to 500 ppm against ``CLOCK_MONOTONIC``, the clock ``time.sleep`` counts (a CI run
measured a 3.0 s sleep as 2.99858 s between two kernel timestamps); twice that, for margin."""
PLACEMENT_S = 0.002
"""Where two processes take the timestamps of one gap (the sidecar after writing a response's
last byte, the client when its kernel received it) differs by up to a scheduling delay."""
STEP_S = 0.005
"""``CLOCK_REALTIME`` may also be stepped while a test sleeps (a VM's time sync): a CI run
measured an 0.8 s ``asyncio.sleep`` as 0.79698 s between the two ends of the span around it,
3 ms short. The span opens before the sleep and ends after it, and asyncio rounds its waits
up on the monotonic clock, so a step of the wall clock is what is left to explain it."""


def slept(seconds: float) -> float:
    """The least a wall-clock interval can measure around a sleep of ``seconds``."""
    return seconds * (1 - SLEW) - PLACEMENT_S - STEP_S
