"""Fixtures shared by the tests that run real sidecar processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.unit import sidecar_harness


@pytest.fixture(scope="module")
def fake_upstream() -> Iterator[str]:
    """The fake OpenAI-style upstream process (``fake_openai.py``): its base URL."""
    with sidecar_harness.upstream() as url:
        yield url
