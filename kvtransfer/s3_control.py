"""S3Location and S3Control: where an S3-compatible object store keeps the shared KV store
(`s3://bucket/prefix`, an endpoint, a region) and the few control requests NIXL's object
backend does not make: list a prefix, delete an object, create the bucket. No block's bytes go
through here (they go through NIXL's OBJ backend, kvtransfer/object_blocks.py). Owns no state
beyond the location; credentials are read from the standard AWS environment variables at each
request and never kept in a message or a log line.

Requests go through botocore, path-style (what S3-compatible servers expect).
"""

from __future__ import annotations

import contextlib
import os
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

SCHEME = "s3://"
DEFAULT_REGION = "us-east-1"
TIMEOUT_S = 10.0  # a list or delete request's whole wait


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
    """Listing, deletion and bucket creation at one location, through botocore's S3 client
    (synchronous; OSError on failure, the S3 error code in its message). Credentials are
    botocore's usual chain (the AWS_* environment variables first); with none, requests go
    unsigned, for a server that allows anonymous access."""

    def __init__(self, location: S3Location):
        self.location = location
        self._client: Any = None  # made at the first request

    def list(self, prefix: str) -> list[S3Object]:
        """Every object whose key starts with prefix (ListObjectsV2, page by page)."""
        found: list[S3Object] = []
        pages = self._s3().get_paginator("list_objects_v2")
        with _as_os_error("LIST", self.location.bucket, prefix):
            for page in pages.paginate(Bucket=self.location.bucket, Prefix=prefix):
                found.extend(
                    S3Object(item["Key"], item["LastModified"].timestamp(), item["Size"])
                    for item in page.get("Contents", ())
                )
        return found

    def delete(self, key: str) -> None:
        """Remove an object (none there is no error: S3's DELETE is idempotent)."""
        with _as_os_error("DELETE", self.location.bucket, key):
            self._s3().delete_object(Bucket=self.location.bucket, Key=key)

    def create_bucket(self) -> None:
        """Create the bucket unless this account has it already."""
        try:
            with _as_os_error("PUT", self.location.bucket, ""):
                self._s3().create_bucket(Bucket=self.location.bucket)
        except OSError as e:
            if "BucketAlreadyOwnedByYou" not in str(e) and "BucketAlreadyExists" not in str(e):
                raise

    def _s3(self) -> Any:
        if self._client is None:
            import botocore.session
            from botocore import UNSIGNED
            from botocore.config import Config

            session = botocore.session.get_session()
            signed = session.get_credentials() is not None
            config = Config(
                connect_timeout=TIMEOUT_S,
                read_timeout=TIMEOUT_S,
                retries={"mode": "standard", "max_attempts": 2},
                s3={"addressing_style": "path"},
                **({} if signed else {"signature_version": UNSIGNED}),
            )
            loc = self.location
            self._client = session.create_client(
                "s3", region_name=loc.region, endpoint_url=loc.endpoint, config=config
            )
        return self._client


@contextlib.contextmanager
def _as_os_error(method: str, bucket: str, key: str) -> Iterator[None]:
    """botocore's errors as OSError naming the request and S3's error code (never a secret)."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except ClientError as e:
        error = e.response.get("Error", {})
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "?")
        raise OSError(
            f"S3 {method} {bucket}/{key}: HTTP {status} {error.get('Code', '')}"
        ) from None
    except BotoCoreError as e:  # no connection, a timeout, no credentials where required
        raise OSError(f"S3 {method} {bucket}/{key}: {e}") from None
