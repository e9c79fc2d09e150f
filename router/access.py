"""API keys: owns the key -> tenant table read from an `--api-keys` file (keys kept only as
SHA-256 digests), the rule for finding the key in a request's headers or metadata, and the rule
that turns a tenant (plus the client's own cache_salt) into the cache_salt the cluster sees.

File format: one `KEY TENANT [NAME=VALUE ...]` per line, separated by whitespace; `#` starts a
comment (so no key starts with `#`), blank lines are ignored. A key is 16 or more visible ASCII
characters; a tenant may have several keys (rotation), a key only one tenant. The optional
columns are the tenant's: its per-key limits (router/tenant_limits.py: `rps=5 tpm=20000
streams=4`) and its traffic class (router/traffic_class.py: `class=interactive|batch weight=N`),
given on one of its lines (its other lines give none or the same).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from router.errors import Unauthenticated
from router.tenant_limits import LIMIT_NAMES, NO_LIMITS, TenantLimits, limits_from_options
from router.traffic_class import DEFAULT_CLASS, OPTIONS, KeyClass, key_class

logger = logging.getLogger(__name__)

MIN_KEY_LENGTH = 16
_KEY_CHARS = re.compile(r"[\x21-\x7e]+")  # visible ASCII: what an HTTP header can carry as is
_TENANT_CHARS = re.compile(r"[A-Za-z0-9._:@/-]+")
MISSING_KEY = "missing API key: send `Authorization: Bearer KEY` (or `x-api-key: KEY`)"
WRONG_KEY = "invalid API key"
NOT_BEARER = (
    "the Authorization header is not `Bearer KEY`: send `Authorization: Bearer KEY` (or "
    "`x-api-key: KEY`)"
)


class ApiKeysFileError(ValueError):
    """An --api-keys file kvrelay refuses; names the file and line, never the key."""


@dataclass(frozen=True)
class ApiKeys:
    """Which tenant each key belongs to. Holds digests, not keys: a repr or a log shows none."""

    source: str
    tenant_by_digest: Mapping[str, str] = field(repr=False)
    limits_by_tenant: Mapping[str, TenantLimits] = field(default_factory=dict)  # given ones only
    class_by_tenant: Mapping[str, KeyClass] = field(default_factory=dict)

    def key_class(self, tenant: str | None) -> KeyClass:
        """The tenant's class and weight (the default for one given none, or no tenant)."""
        return self.class_by_tenant.get(tenant, DEFAULT_CLASS) if tenant else DEFAULT_CLASS

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(self.tenant_by_digest.values())

    @property
    def num_keys(self) -> int:
        return len(self.tenant_by_digest)

    def limits(self, tenant: str) -> TenantLimits:
        """The tenant's limits from the file (none given: TenantLimits(), no limit)."""
        return self.limits_by_tenant.get(tenant, NO_LIMITS)

    def tenant(self, key: str) -> str | None:
        """The key's tenant, or None for a key not in the file."""
        return self.tenant_by_digest.get(_digest(key))

    def authenticate(self, authorization: str | None, x_api_key: str | None) -> str:
        """The tenant of the request's key; raises Unauthenticated when it is missing or wrong."""
        key = presented_key(authorization, x_api_key)
        if key is None:
            raise Unauthenticated(
                NOT_BEARER if authorization and authorization.strip() else MISSING_KEY
            )
        tenant = self.tenant(key)
        if tenant is None:
            raise Unauthenticated(WRONG_KEY)
        return tenant

    @classmethod
    def load(cls, path: str | Path) -> ApiKeys:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8-sig")  # a Windows editor's BOM: not a key
            mode = path.stat().st_mode
        except (OSError, UnicodeDecodeError) as e:
            raise ApiKeysFileError(f"--api-keys {path}: cannot read it ({e})") from None
        if mode & stat.S_IROTH and os.name == "posix":
            logger.warning("API key file %s is readable by every user (chmod 600 it)", path)
        return cls.parse(text, str(path))

    @classmethod
    def single(cls, key: str, tenant: str = "default") -> ApiKeys:
        """One key for every client (--api-key, as vLLM's): one tenant."""
        _check_key(key, "--api-key")
        return cls("--api-key", MappingProxyType({_digest(key): tenant}))

    @classmethod
    def parse(cls, text: str, source: str = "<api keys>") -> ApiKeys:
        tenant_by_digest: dict[str, str] = {}
        first_line: dict[str, int] = {}
        limits_by_tenant: dict[str, TenantLimits] = {}
        limits_line: dict[str, int] = {}
        classes: dict[str, tuple[KeyClass, int]] = {}  # tenant -> (class, line that gave it)
        for lineno, line in enumerate(text.splitlines(), 1):
            fields = _before_comment(line.split())
            if not fields:
                continue
            where = f"{source}:{lineno}"
            if len(fields) < 2:
                raise ApiKeysFileError(f"{where}: expected `KEY TENANT [NAME=VALUE ...]`")
            key, tenant, *columns = fields
            options = parse_key_options(columns, where)
            class_options = {n: v for n, v in options.items() if n in OPTIONS}
            if class_options:
                _add_class(classes, tenant, class_options, lineno, where)
            _check_key(key, where)
            if not _TENANT_CHARS.fullmatch(tenant):
                raise ApiKeysFileError(
                    f"{where}: tenant {tenant!r} may hold only letters, digits and ._:@/-"
                )
            digest = _digest(key)
            if digest in first_line:
                raise ApiKeysFileError(
                    f"{where}: this key was already given on line {first_line[digest]}"
                )
            first_line[digest] = lineno
            tenant_by_digest[digest] = tenant
            limits = _limits(options, where)
            if limits.any:
                earlier = limits_by_tenant.get(tenant)
                if earlier is not None and earlier != limits:
                    raise ApiKeysFileError(
                        f"{where}: tenant {tenant!r} has other limits on line "
                        f"{limits_line[tenant]} ({earlier.describe()}); give them once"
                    )
                limits_by_tenant[tenant] = limits
                limits_line.setdefault(tenant, lineno)
        if not tenant_by_digest:
            raise ApiKeysFileError(f"{source}: no `KEY TENANT` line (an empty file admits no one)")
        class_by_tenant = {tenant: kind for tenant, (kind, _) in classes.items()}
        return cls(
            source,
            MappingProxyType(tenant_by_digest),
            MappingProxyType(limits_by_tenant),
            MappingProxyType(class_by_tenant),
        )


def parse_key_options(columns: list[str], where: str) -> dict[str, str]:
    """A key line's columns after KEY TENANT, each `NAME=VALUE` (NAME a limit or a class option,
    once); ApiKeysFileError naming the line and the column."""
    known = (*LIMIT_NAMES, *OPTIONS)
    options: dict[str, str] = {}
    for column in columns:
        name, eq, value = column.partition("=")
        if not eq or not value:
            raise ApiKeysFileError(f"{where}: {column!r} is not NAME=VALUE")
        if name not in known:
            raise ApiKeysFileError(f"{where}: unknown column {name!r} (known: {', '.join(known)})")
        if name in options:
            raise ApiKeysFileError(f"{where}: {name} is given twice")
        options[name] = value
    return options


def _limits(options: dict[str, str], where: str) -> TenantLimits:
    """The limit columns of a key line's options, checked."""
    try:
        return limits_from_options({n: v for n, v in options.items() if n in LIMIT_NAMES}, where)
    except ValueError as e:
        raise ApiKeysFileError(str(e)) from None


def presented_key(authorization: str | None, x_api_key: str | None) -> str | None:
    """The key a request carries: `Authorization: Bearer KEY`, else `x-api-key: KEY`."""
    if authorization:
        scheme, _, value = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    if x_api_key and x_api_key.strip():
        return x_api_key.strip()
    return None


def tenant_cache_salt(tenant: str, client_salt: str | None) -> str:
    """The cache_salt the cluster sees for a tenant's request: a hash of the tenant and the
    client's own salt, so no choice of client salt reaches another tenant's prefix cache."""
    material = json.dumps(["kvrelay-tenant-salt-v1", tenant, client_salt]).encode()
    return hashlib.sha256(material).hexdigest()


def _before_comment(fields: list[str]) -> list[str]:
    """The fields before the first that starts with `#` (a comment runs to the line's end)."""
    for i, text in enumerate(fields):
        if text.startswith("#"):
            return fields[:i]
    return fields


def _add_class(
    classes: dict[str, tuple[KeyClass, int]],
    tenant: str,
    options: dict[str, str],
    lineno: int,
    where: str,
) -> None:
    """Record the tenant's class from a line's options; a different one on another line is an
    error (the router's queue shares by tenant)."""
    try:
        kind = key_class(options)
    except ValueError as e:
        raise ApiKeysFileError(f"{where}: {e}") from None
    known = classes.get(tenant)
    if known is not None and known[0] != kind:
        before, now = known[0], kind
        raise ApiKeysFileError(
            f"{where}: tenant {tenant!r} has class={now.kind.value} weight={now.weight} here but "
            f"class={before.kind.value} weight={before.weight} on line {known[1]}; a tenant's "
            "keys share one class and weight (an option left out is its default: "
            "class=interactive, weight=1)"
        )
    classes.setdefault(tenant, (kind, lineno))


def _check_key(key: str, where: str) -> None:
    if not _KEY_CHARS.fullmatch(key):
        raise ApiKeysFileError(f"{where}: the key holds characters other than visible ASCII")
    if len(key) < MIN_KEY_LENGTH:
        raise ApiKeysFileError(
            f"{where}: the key is {len(key)} characters; use at least {MIN_KEY_LENGTH} "
            "(e.g. `openssl rand -hex 24`)"
        )


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()
