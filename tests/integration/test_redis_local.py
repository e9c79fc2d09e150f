"""deploy.redis_local: the embedded redis-server's start, restart, failure messages and exit;
serve keeping it (LocalCluster.keep_redis) when it dies."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from deploy.local_cluster import ClusterSpec, LocalCluster
from deploy.redis_local import (
    LocalRedis,
    RedisServerNotFound,
    RedisStartError,
    ping,
    redis_url_or_local,
)


def test_start_restart_on_the_same_port_and_stop() -> None:
    with LocalRedis() as server:
        port, pid = server.port, server.pid
        assert ping(server.host, port) and server.url == f"redis://127.0.0.1:{port}/0"
        server.restart()
        assert server.port == port and server.pid != pid and ping(server.host, port)
        server.stop()
        assert not server.running and not ping(server.host, port)
    assert server.pid is None


def test_a_taken_port_is_a_clear_error() -> None:
    with LocalRedis() as server, pytest.raises(RedisStartError, match="Address already in use"):
        LocalRedis(port=server.port).start()


def test_missing_binary_says_how_to_install_it() -> None:
    with pytest.raises(RedisServerNotFound, match="apt-get install -y redis-server"):
        LocalRedis(binary="kvrelay-no-such-redis-server").start()


def test_redis_url_or_local() -> None:
    with redis_url_or_local("redis://elsewhere:6379/0") as url:
        assert url == "redis://elsewhere:6379/0"
    with redis_url_or_local(None) as url:
        host_port = url.removeprefix("redis://").removesuffix("/0")
        host, port = host_port.rsplit(":", 1)
        assert ping(host, int(port))
    assert not ping(host, int(port))  # stopped on exit


def test_serves_redis_server_killed_is_started_again_on_its_port_and_reaped() -> None:
    """kill -9 of serve's embedded redis-server: LocalCluster.keep_redis reaps it, starts it
    again, empty, on the same port (clients holding the URL reconnect), and says so once."""
    said: list[str] = []

    async def body(cluster: LocalCluster) -> None:
        keeper = asyncio.create_task(cluster.keep_redis(said.append, every_s=0.05))
        killed = cluster.redis.pid
        os.kill(killed, signal.SIGKILL)
        for _ in range(200):
            await asyncio.sleep(0.05)
            if said:
                break
        keeper.cancel()
        assert cluster.redis.running and cluster.redis.pid != killed
        assert ping(cluster.redis.host, cluster.redis.port)
        with pytest.raises(ChildProcessError):
            os.waitpid(killed, os.WNOHANG)  # reaped: no zombie left

    cluster = LocalCluster(ClusterSpec())
    with LocalRedis() as server:
        cluster.redis = server
        port = server.port
        asyncio.run(body(cluster))
        assert server.port == port
    [line] = said
    assert line.startswith("kvrelay: the embedded redis-server exited (status -9); started it")
