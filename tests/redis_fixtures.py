"""Pytest fixtures for a real redis-server; holds no state beyond each fixture's server.

Import into tests/conftest.py: `from tests.redis_fixtures import redis_server, redis_url`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.redis_server import RedisServer


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh, empty redis-server per test (~20 ms to start); the test may stop/restart it."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url
