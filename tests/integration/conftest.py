"""Fixtures of the integration tests: an event loop per module for the cluster tests."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop for a module's cluster (its router state lives on this loop)."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()
