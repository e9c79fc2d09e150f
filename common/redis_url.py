"""Redis URLs as kvrelay's clients take them (no state): checking one, redacting its secrets for a
log line, saying in one line why the Redis behind it failed, and the routers' client over one.

redis-py's `from_url` reads `redis://[user]:[password]@host:port/db`, `rediss://` (TLS) and
`unix://[user]:[password]@/path?db=N`; query parameters become connection keyword arguments
(`ssl_ca_certs=/path/ca.pem`, `ssl_cert_reqs=required`, ...), and any it does not know make the
first connection fail with a TypeError. check_url() refuses such a URL up front instead.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable
from typing import Any, NamedTuple
from urllib.parse import unquote

from redis.asyncio.connection import Connection as AsyncConnection
from redis.asyncio.connection import parse_url as parse_async_url
from redis.connection import Connection, parse_url
from redis.exceptions import AuthenticationError, NoPermissionError, RedisError

SCHEMES = ("redis", "rediss", "unix")
SECRET_QUERY_PARAMS = frozenset({"password", "ssl_password"})  # redis-py takes both from a query
_CLIENTS = ((parse_url, Connection), (parse_async_url, AsyncConnection))  # workers', router's
_PATH_PARAMS = {
    "ssl_ca_certs": os.path.isfile,
    "ssl_certfile": os.path.isfile,
    "ssl_keyfile": os.path.isfile,
    "ssl_ca_path": os.path.isdir,
}


def redact(url: str) -> str:
    """`url` with its password (and any password / ssl_password query value) replaced by ***.

    Never raises: it is meant for log lines, including ones about a malformed URL."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    userinfo, host, tail = _split_netloc(rest)
    netloc = host
    if userinfo is not None:
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:***@{host}" if colon else f"{user}@{host}"
    path, qmark, query = tail.partition("?")
    if qmark:
        query, hash_, fragment = query.partition("#")
        parts = [_redact_param(part) for part in query.split("&")]
        tail = f"{path}?{'&'.join(parts)}{hash_}{fragment}"
    return f"{scheme}://{netloc}{tail}"


def check_url(url: str) -> str:
    """`url` unchanged if redis-py can build a connection from it; else a ValueError saying why
    (the URL in it redacted). Checks the scheme, the query parameters' names and values for that
    scheme, and that the TLS files it names exist on this machine."""
    shown = redact(url)
    scheme = url.partition("://")[0].lower()
    if scheme not in SCHEMES:
        raise ValueError(
            f"Redis URL {shown}: the scheme must be redis://, rediss:// (TLS) or unix://"
        )
    for parse, plain_class in _CLIENTS:  # both must take it: the URL goes to both clients
        kwargs = _build_connection(url, parse, plain_class)
    for name, exists in _PATH_PARAMS.items():
        path = kwargs.get(name)
        if isinstance(path, str) and not exists(path):
            raise ValueError(f"Redis URL {shown}: {name}={path} is not on this machine")
    return url


class RedisFailure(NamedTuple):
    """Why a call to a Redis failed: `kind` is "auth" (password refused or missing, or a command
    the ACL user may not run), "tls" (the handshake failed: CA, hostname, certificate) or
    "unreachable" (anything else); `message` is one log line."""

    kind: str
    message: str


def describe_failure(url: str, exc: BaseException) -> RedisFailure:
    """What a failed call to the Redis at `url` means, with the URL's secrets redacted."""
    where = f"Redis at {redact(url)}"
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, AuthenticationError):
        if not _has_password(url):
            return RedisFailure("auth", f"{where} requires a password, none in the URL ({detail})")
        return RedisFailure("auth", f"{where} refused the password ({detail})")
    if isinstance(exc, NoPermissionError):
        return RedisFailure("auth", f"{where}: the ACL user may not do this ({detail})")
    if isinstance(exc.__cause__ or exc.__context__, ssl.SSLError) or "[SSL" in str(exc):
        return RedisFailure("tls", f"{where}: the TLS handshake failed ({detail})")
    return RedisFailure("unreachable", f"{where} unreachable ({detail})")


def _build_connection(url: str, parse: Callable[[str], Any], plain_class: type) -> dict[str, Any]:
    """The keyword arguments `parse` reads from `url`, once a connection was built with them."""
    shown, scheme = redact(url), url.partition("://")[0].lower()
    try:
        kwargs = dict(parse(url))
    except ValueError as exc:
        raise ValueError(f"Redis URL {shown}: {exc}") from None
    connection_class = kwargs.pop("connection_class", plain_class)  # set for rediss:, unix:
    try:
        connection_class(**kwargs)  # builds the connection object only; nothing is dialled
    except TypeError as exc:
        tls_only = scheme != "rediss" and any(name.startswith("ssl_") for name in kwargs)
        hint = " (ssl_* parameters need rediss://)" if tls_only else ""
        message = f"Redis URL {shown}: redis-py refused a query parameter{hint}: {exc}"
        raise ValueError(message) from None
    except RedisError as exc:  # e.g. ssl_cert_reqs not none / optional / required
        raise ValueError(f"Redis URL {shown}: {exc}") from None
    return kwargs


def _has_password(url: str) -> bool:
    try:
        return bool(parse_url(url).get("password"))
    except ValueError:
        return True


def _split_netloc(rest: str) -> tuple[str | None, str, str]:
    """What follows `scheme://` as (userinfo or None, host[:port] or a unix path, the rest).

    The userinfo ends at the last @ before any ? or #, so a password with a raw / in it (not
    percent-encoded, which redis-py would misread anyway) is still redacted."""
    end = min((i for i in (rest.find(c) for c in "?#") if i >= 0), default=len(rest))
    at = rest.rfind("@", 0, end)
    userinfo = rest[:at] if at >= 0 else None
    rest = rest[at + 1 :]
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    return userinfo, rest[:end], rest[end:]


def _redact_param(part: str) -> str:
    name, eq, _ = part.partition("=")
    return f"{name}=***" if eq and unquote(name) in SECRET_QUERY_PARAMS else part


def router_client(redis_url: str, timeout_s: float) -> Any:
    """A router's asyncio client of redis_url: calls fail within timeout_s (one retry on a
    broken connection, no backoff) so a request never waits on a Redis that is down; str
    replies. redis_url: checked (check_url) by the caller."""
    from redis.asyncio import Redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError

    return Redis.from_url(
        redis_url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        decode_responses=True,
    )
