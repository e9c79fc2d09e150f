"""common.redis_url: secrets redacted from log lines, URLs redis-py cannot use refused up front,
and a failure described by its cause (no Redis server needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from redis.exceptions import AuthenticationError, ConnectionError, NoPermissionError

from common.kv_publisher import KVPublisher
from common.redis_url import check_url, describe_failure, redact
from deploy.cli import build_parser
from deploy.serve import spec_from_args
from router.prefix_index import PrefixIndex


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cret@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://kvrelay:s3cret@h:6379/0", "redis://kvrelay:***@h:6379/0"),
        ("redis://:p%40ss%3Aw%2Frd@h/0", "redis://:***@h/0"),
        ("redis://:raw/slash@h:1/0", "redis://:***@h:1/0"),  # not encoded: still hidden
        ("redis://:pw@[::1]:6379/2", "redis://:***@[::1]:6379/2"),
        (
            "rediss://u:pw@h:6380/0?ssl_ca_certs=/etc/ca.pem&ssl_password=keypw#x",
            "rediss://u:***@h:6380/0?ssl_ca_certs=/etc/ca.pem&ssl_password=***#x",
        ),
        ("redis://h:6379/0?password=s3cret&db=1", "redis://h:6379/0?password=***&db=1"),
        ("unix://:pw@/run/redis.sock?db=0", "unix://:***@/run/redis.sock?db=0"),
        ("redis://h:6379/0", "redis://h:6379/0"),
        ("redis://kvrelay@h:6379", "redis://kvrelay@h:6379"),  # a user name alone is kept
        ("unix:///run/redis.sock", "unix:///run/redis.sock"),
        ("not a url", "not a url"),
        ("", ""),
    ],
)
def test_redact_hides_passwords_and_keeps_the_rest(url: str, shown: str) -> None:
    assert redact(url) == shown


@pytest.mark.parametrize(
    "url",
    [
        "redis://h:6379/0",
        "redis://:pw@h:6379/0",
        "redis://user:pw@h:6379/3?socket_timeout=2&health_check_interval=10",
        "rediss://h:6380/0",
        "rediss://:pw@h:6380/0?ssl_cert_reqs=none",
        "rediss://h:6380/0?ssl_cert_reqs=required&ssl_check_hostname=false&ssl_min_version=771",
        "unix:///run/redis.sock?db=1",
    ],
)
def test_check_url_accepts_what_redis_py_can_use(url: str) -> None:
    assert check_url(url) == url


def test_check_url_accepts_tls_files_that_exist(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("")
    url = f"rediss://:pw@h:6380/0?ssl_ca_certs={ca}&ssl_cert_reqs=required"
    assert check_url(url) == url


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://:pw@h:6379/0", r"scheme must be redis://, rediss:// \(TLS\) or unix://"),
        ("h:6379", "scheme must be"),
        ("redis://:pw@h/0?ssl_ca_certs=/etc/ca.pem", r"ssl_\* parameters need rediss://"),
        ("redis://:pw@h/0?sslcacerts=/etc/ca.pem", "unexpected keyword argument 'sslcacerts'"),
        ("rediss://:pw@h/0?ssl_cert_reqs=yes", "Invalid SSL Certificate Requirements Flag: yes"),
        ("rediss://:pw@h/0?ssl_ca_certs=/no/such/ca.pem", "ssl_ca_certs=/no/such/ca.pem is not"),
        ("redis://:pw@h/0?db=zero", "Invalid value for 'db'"),
        ("rediss://:pw@h/0?ssl_validate_ocsp=1", "'ssl_validate_ocsp'"),  # the router's refuses
    ],
)
def test_check_url_refuses_with_the_reason_and_no_password(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as info:
        check_url(url)
    assert "pw" not in str(info.value)


def test_the_clients_and_kvrelay_serve_refuse_a_bad_url_before_connecting() -> None:
    bad = "redis://:pw@127.0.0.1:1/0?ssl_ca_certs=/etc/ca.pem"
    with pytest.raises(ValueError, match="need rediss://"):
        KVPublisher(bad, "m", "w", "prefill", cached_hashes=list)
    with pytest.raises(ValueError, match="need rediss://"):
        PrefixIndex(bad, "m")
    with pytest.raises(ValueError, match="need rediss://"):
        spec_from_args(build_parser().parse_args(["serve", "--redis-url", bad]))
    args = ["serve", "--redis-url", bad, "--no-redis"]
    assert spec_from_args(build_parser().parse_args(args)).redis_url == ""
    assert spec_from_args(build_parser().parse_args(["serve"])).redis_url is None


def test_describe_failure_names_the_cause_and_hides_the_password() -> None:
    url, no_password = "redis://:pw@h:6379/0", "redis://h:6379/0"
    refused = AuthenticationError("invalid username-password pair or user is disabled.")
    assert describe_failure(url, refused) == (
        "auth",
        "Redis at redis://:***@h:6379/0 refused the password (AuthenticationError: invalid "
        "username-password pair or user is disabled.)",
    )
    kind, message = describe_failure(no_password, AuthenticationError("Authentication required."))
    assert kind == "auth" and "requires a password, none in the URL" in message
    kind, message = describe_failure(url, NoPermissionError("this user has no permissions"))
    assert kind == "auth" and "the ACL user may not do this" in message
    tls = ConnectionError("Error 1 connecting to h:6380. [SSL: CERTIFICATE_VERIFY_FAILED] ...")
    assert describe_failure(url, tls).kind == "tls"
    down = ConnectionError("Error 111 connecting to h:6379. Connection refused.")
    kind, message = describe_failure(url, down)
    assert kind == "unreachable" and message.startswith("Redis at redis://:***@h:6379/0 unreach")
    assert describe_failure(url, TimeoutError()).message.endswith("unreachable (TimeoutError)")
