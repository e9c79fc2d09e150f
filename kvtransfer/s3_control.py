"""S3Location and S3Control: where an S3-compatible object store keeps the shared KV store
(`s3://bucket/prefix`, an endpoint, a region) and the few control requests NIXL's object
backend does not make: list a prefix, delete an object, create the bucket. No block's bytes go
through here (they go through NIXL's OBJ backend, kvtransfer/object_blocks.py). Owns no state
beyond the location; credentials are read from the standard AWS environment variables at each
request and never kept in a message or a log line.

Requests are path-style and signed with AWS Signature Version 4 (unsigned when no credentials
are set, for a server that allows anonymous access).
"""

from __future__ import annotations

import calendar
import hashlib
import hmac
import os
import time
import urllib.error
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import NamedTuple

SCHEME = "s3://"
DEFAULT_REGION = "us-east-1"
TIMEOUT_S = 10.0  # a list or delete request's whole wait
_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def is_object_url(path: str | None) -> bool:
    """Whether a shared store location names an object store (s3://bucket/prefix)."""
    return bool(path) and str(path).startswith(SCHEME)


@dataclass(frozen=True)
class S3Location:
    """An object store's bucket and key prefix, and the endpoint that serves it."""

    bucket: str
    prefix: str  # no leading or trailing slash ("" for the bucket's root)
    endpoint: str  # scheme://host[:port]
    region: str

    @classmethod
    def parse(cls, url: str, endpoint: str | None = None) -> S3Location:
        """From `s3://bucket/prefix` and an endpoint URL (None: AWS_ENDPOINT_URL, else AWS's
        own for the region). Raises ValueError naming what is wrong."""
        if not is_object_url(url):
            raise ValueError(f"shared_kv_path: an object store is s3://BUCKET/PREFIX, got {url!r}")
        bucket, _, prefix = url.removeprefix(SCHEME).partition("/")
        if not bucket:
            raise ValueError(f"shared_kv_path: no bucket name in {url!r}")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        region = region or DEFAULT_REGION
        endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL")
        endpoint = endpoint or f"https://s3.{region}.amazonaws.com"
        parts = urllib.parse.urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"shared_kv_endpoint: an http:// or https:// URL, got {endpoint!r}")
        return cls(bucket, prefix.strip("/"), f"{parts.scheme}://{parts.netloc}", region)

    @property
    def url(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}".rstrip("/")

    def key(self, *parts: str) -> str:
        """An object's key under the prefix."""
        return "/".join(p for p in (self.prefix, *parts) if p)


class S3Object(NamedTuple):
    """One object of a listing."""

    key: str
    mtime: float  # its LastModified (seconds since the epoch)
    size: int


class S3Control:
    """Listing, deletion and bucket creation at one location (synchronous; OSError on
    failure, an HTTP error's status and S3 code in its message)."""

    def __init__(self, location: S3Location):
        self.location = location

    def list(self, prefix: str) -> list[S3Object]:
        """Every object whose key starts with prefix (ListObjectsV2, page by page)."""
        found: list[S3Object] = []
        token = None
        while True:
            query = {"list-type": "2", "prefix": prefix}
            if token:
                query["continuation-token"] = token
            root = ET.fromstring(self._request("GET", "", query))
            for item in root.iter(f"{_NS}Contents"):
                found.append(
                    S3Object(
                        item.findtext(f"{_NS}Key", ""),
                        _epoch(item.findtext(f"{_NS}LastModified", "")),
                        int(item.findtext(f"{_NS}Size", "0")),
                    )
                )
            token = root.findtext(f"{_NS}NextContinuationToken")
            if root.findtext(f"{_NS}IsTruncated") != "true" or not token:
                return found

    def delete(self, key: str) -> None:
        """Remove an object (none there is no error: S3's DELETE is idempotent)."""
        self._request("DELETE", key)

    def create_bucket(self) -> None:
        """Create the bucket unless this account has it already."""
        try:
            self._request("PUT", "")
        except OSError as e:
            if "BucketAlreadyOwnedByYou" not in str(e) and "BucketAlreadyExists" not in str(e):
                raise

    # ---- a signed request -----------------------------------------------------------------
    def _request(self, method: str, key: str, query: dict[str, str] | None = None) -> bytes:
        loc = self.location
        path = "/" + urllib.parse.quote(loc.bucket + ("/" + key if key else ""), safe="/-_.~")
        canonical_query = "&".join(
            f"{_quote(k)}={_quote(v)}" for k, v in sorted((query or {}).items())
        )
        host = urllib.parse.urlsplit(loc.endpoint).netloc
        headers = {"host": host, "x-amz-content-sha256": _EMPTY_SHA256}
        _sign(method, path, canonical_query, headers, loc.region)
        url = loc.endpoint + path + ("?" + canonical_query if canonical_query else "")
        request = urllib.request.Request(url, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as reply:
                return reply.read()
        except urllib.error.HTTPError as e:
            body = e.read()[:1000].decode(errors="replace")
            code = _s3_code(body)
            raise OSError(f"S3 {method} {loc.bucket}/{key}: HTTP {e.code} {code}") from None


def _quote(text: str) -> str:
    return urllib.parse.quote(text, safe="-_.~")


def _s3_code(body: str) -> str:
    try:
        return ET.fromstring(body).findtext("Code") or ""
    except ET.ParseError:
        return ""


def _epoch(stamp: str) -> float:
    """ISO 8601 UTC (2026-12-06T14:23:06.000Z) as seconds since the epoch."""
    whole, _, frac = stamp.rstrip("Z").partition(".")
    try:
        base = calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return 0.0
    return base + (float("0." + frac) if frac.isdigit() else 0.0)


def _sign(method: str, path: str, query: str, headers: dict[str, str], region: str) -> None:
    """Add AWS Signature Version 4 headers (none without AWS_ACCESS_KEY_ID and
    AWS_SECRET_ACCESS_KEY in the environment: an anonymous request)."""
    access = os.environ.get("AWS_ACCESS_KEY_ID")
    secret = os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not access or not secret:
        return
    now = time.gmtime()
    amz_date = time.strftime("%Y%m%dT%H%M%SZ", now)
    day = amz_date[:8]
    headers["x-amz-date"] = amz_date
    token = os.environ.get("AWS_SESSION_TOKEN")
    if token:
        headers["x-amz-security-token"] = token
    names = sorted(headers)
    signed = ";".join(names)
    canonical = "\n".join(
        [
            method,
            path,
            query,
            "".join(f"{n}:{headers[n].strip()}\n" for n in names),
            signed,
            headers["x-amz-content-sha256"],
        ]
    )
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(
        ["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()]
    )
    key = ("AWS4" + secret).encode()
    for part in (day, region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={access}/{scope}, SignedHeaders={signed}, "
        f"Signature={signature}"
    )
