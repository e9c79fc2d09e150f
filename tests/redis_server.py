"""Test support: a real, throw-away redis-server (deploy.redis_local.LocalRedis) plus fault knobs.

Owns nothing beyond what LocalRedis owns; adds pause/resume (SIGSTOP/SIGCONT) to simulate a hung
Redis. `make test` installs redis-server (apt-get install -y redis-server) when it is missing.
"""

from __future__ import annotations

import os
import signal

from deploy.redis_local import LocalRedis, RedisServerNotFound, ping

__all__ = ["RedisServer", "RedisServerNotFound", "ping"]


class RedisServer(LocalRedis):
    """A LocalRedis on 127.0.0.1 for tests: `with RedisServer() as server: server.url`.

    stop() kills it (a crash), restart() brings it back empty on the same port, pause() freezes
    it so connections hang (only client timeouts end them) until resume() (stop() works paused).
    """

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, signum: int) -> None:
        if self.pid is None:
            raise RuntimeError("redis-server is not running")
        os.kill(self.pid, signum)
