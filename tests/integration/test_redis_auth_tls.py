"""KVPublisher -> real redis-server -> PrefixIndex over a password URL, an ACL user's URL and
rediss:// (TLS, with a throw-away CA); a wrong password, none, or a missing CA is one clear log
line naming the redacted URL, never a traceback, and the clients recover once it is fixed."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from deploy.redis_local import RedisStartError, RedisTLS, ping
from router.prefix_index import IndexUnavailable, PrefixIndex
from tests.integration.test_prefix_index import PoolWorker, prompt_hashes, run
from tests.redis_server import RedisServer
from tests.tls_certs import TLSToolsMissing, make_server_certs

PASSWORD = "p@ss:w/rd %+"  # characters a URL must percent-encode
ENCODED = quote(PASSWORD, safe="")
ACL_RULES = ["~kvr:*", "-@all", "+@read", "+@write", "+@scripting", "+@transaction"]
ACL_RULES += ["+@connection"]  # what README "Redis URLs" says an ACL user needs


@pytest.fixture
def password_redis() -> Iterator[RedisServer]:
    with RedisServer(password=PASSWORD) as server:
        yield server


@pytest.fixture
def server_certs(tmp_path: Path) -> RedisTLS:
    try:
        return make_server_certs(tmp_path)
    except TLSToolsMissing as exc:
        pytest.skip(f"cannot make a test certificate: {exc}")


def start_tls_redis(certs: RedisTLS, password: str | None = None) -> RedisServer:
    server = RedisServer(tls=certs, password=password)
    try:
        return server.start()
    except RedisStartError as exc:
        server.close()
        if "tls" in str(exc).lower():
            pytest.skip(f"this redis-server was built without TLS: {exc}")
        raise


@pytest.fixture
def tls_redis(server_certs: RedisTLS) -> Iterator[RedisServer]:
    server = start_tls_redis(server_certs)
    with server:
        yield server


def with_acl_user(server: RedisServer) -> str:
    """Create the ACL user kvrelay (README's rules) on `server`; its URL."""
    admin = redis.Redis.from_url(server.url)
    with admin:
        admin.execute_command("ACL", "SETUSER", "kvrelay", "on", ">user-secret", *ACL_RULES)
    return server.url.replace(f":{ENCODED}@", "kvrelay:user-secret@")


def publish_and_read_back(url: str) -> None:
    """Two workers publish over `url`; a PrefixIndex over `url` sees their prefixes and load."""
    p = prompt_hashes(4)
    full, half = PoolWorker(url, "full"), PoolWorker(url, "half")
    full.cache(*p)
    half.cache(*p[:2])
    assert full.step(queued_tokens=7) and half.step()
    assert full.publisher.healthy and full.publisher.num_resyncs == 1

    async def body(index: PrefixIndex) -> None:
        assert await index.probe()
        view = await index.view("prefill", p)
        assert view.overlap == {"full": 4, "half": 2}
        assert view.workers[0].load.queued_tokens == 7
        assert await index.prefix_overlap(p, ["half", "nobody"]) == {"half": 2, "nobody": 0}
        assert index.available

    # What is tested is the URL's auth and TLS, not speed: the router's 0.25 s bound on a Redis
    # call (its first connection included: AUTH, TLS handshake) is too tight on a loaded CI box.
    run(body, url, timeout_s=2.0)
    assert full.publisher.withdraw() and half.publisher.withdraw()
    full.publisher.close()
    half.publisher.close()


def test_a_password_url_with_characters_to_encode(password_redis: RedisServer) -> None:
    assert password_redis.url == f"redis://:{ENCODED}@127.0.0.1:{password_redis.port}/0"
    host, port = password_redis.host, password_redis.port
    assert ping(host, port, password=PASSWORD) and not ping(host, port)  # NOAUTH without it
    publish_and_read_back(password_redis.url)


def test_an_acl_user_url_with_the_documented_rules(password_redis: RedisServer) -> None:
    publish_and_read_back(with_acl_user(password_redis))


def test_a_rediss_url_with_the_ca(tls_redis: RedisServer, server_certs: RedisTLS) -> None:
    port = tls_redis.port
    assert tls_redis.url == f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={server_certs.ca_file}"
    assert ping("127.0.0.1", port, tls=server_certs) and not ping("127.0.0.1", port)
    publish_and_read_back(tls_redis.url)
    publish_and_read_back(f"{tls_redis.url}&ssl_cert_reqs=required&ssl_check_hostname=true")
    publish_and_read_back(tls_redis.url.replace("127.0.0.1", "localhost"))  # the SAN's name
    publish_and_read_back(f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=none")  # unverified


def test_a_rediss_url_with_a_password_and_an_acl_user(server_certs: RedisTLS) -> None:
    with start_tls_redis(server_certs, password=PASSWORD) as server:
        assert server.url.startswith(f"rediss://:{ENCODED}@127.0.0.1:")
        publish_and_read_back(server.url)
        publish_and_read_back(with_acl_user(server))


def failure_lines(
    caplog: pytest.LogCaptureFixture, logger: str, level: int = logging.WARNING
) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == logger and r.levelno >= level]


def test_a_wrong_password_is_one_clear_line_then_recovers(
    password_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    wrong = password_redis.url.replace(ENCODED, "wrong-secret")
    shown = f"redis://:***@127.0.0.1:{password_redis.port}/0"
    worker = PoolWorker(wrong, "w")
    worker.cache(*prompt_hashes(2))
    with caplog.at_level(logging.INFO):
        assert not worker.step() and not worker.step()  # never raises into the engine loop
        assert not worker.publisher.healthy

        async def body(index: PrefixIndex) -> None:
            assert not await index.probe()  # at startup: logged before any request
            with pytest.raises(
                IndexUnavailable, match=r"refused the password \(.*\); route by load"
            ):
                await index.view("prefill", [])
            assert not index.available
            admin = redis.Redis.from_url(password_redis.url)
            with admin:  # the server now takes the URL's password: both recover, no restart
                admin.config_set("requirepass", "wrong-secret")
            assert worker.step()
            assert (await index.view("prefill", prompt_hashes(2))).overlap == {"w": 2}
            assert index.available and worker.publisher.healthy

        run(body, wrong)
    for logger in ("common.kv_publisher", "router.prefix_index"):
        (line,) = failure_lines(caplog, logger, logging.ERROR)  # one per outage, not per call
        assert not line.exc_info
        assert f"Redis at {shown} refused the password" in line.getMessage()
    assert "Redis is back" in caplog.text and "reachable again" in caplog.text
    assert "wrong-secret" not in caplog.text and PASSWORD not in caplog.text


def test_no_password_or_no_ca_says_so(
    password_redis: RedisServer, tls_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    no_password = f"redis://127.0.0.1:{password_redis.port}/0"
    no_ca = f"rediss://127.0.0.1:{tls_redis.port}/0"  # the system CAs do not know ours
    plain_to_tls = f"redis://127.0.0.1:{tls_redis.port}/0"
    with caplog.at_level(logging.WARNING, logger="common.kv_publisher"):
        for url in (no_password, no_ca, plain_to_tls):
            assert not PoolWorker(url, "w").step()
    messages = [r.getMessage() for r in failure_lines(caplog, "common.kv_publisher")]
    assert len(messages) == 3
    assert f"Redis at {no_password} requires a password, none in the URL" in messages[0]
    assert f"Redis at {no_ca}: the TLS handshake failed" in messages[1]
    assert "CERTIFICATE_VERIFY_FAILED" in messages[1]
    assert f"Redis at {plain_to_tls} unreachable" in messages[2]


def test_a_url_redis_py_cannot_use_is_refused_before_connecting(
    tls_redis: RedisServer, tmp_path: Path
) -> None:
    missing_ca = tls_redis.url.split("?")[0] + f"?ssl_ca_certs={tmp_path}/none.pem"
    with pytest.raises(ValueError, match=r"ssl_ca_certs=.*none\.pem is not on this machine"):
        PoolWorker(missing_ca, "w")
    with pytest.raises(ValueError, match=r"ssl_\* parameters need rediss://"):
        PrefixIndex(tls_redis.url.replace("rediss://", "redis://"), "m")


def test_certificates_made_with_the_cryptography_package_work_too(tmp_path: Path) -> None:
    pytest.importorskip("cryptography", reason="the fallback when there is no openssl command")
    with start_tls_redis(make_server_certs(tmp_path, tool="cryptography")) as server:
        publish_and_read_back(server.url)
