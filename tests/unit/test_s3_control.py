"""S3Location: an s3:// shared store location and its endpoint parsed, bad ones refused naming
the field; CacheConfig refuses an endpoint without an object store."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, is_object_store
from kvtransfer.s3_control import S3Location


def test_a_location_names_bucket_prefix_endpoint_and_region(monkeypatch):
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    loc = S3Location.parse("s3://kv/cluster-a/", "http://minio:9000/ignored")
    assert (loc.bucket, loc.prefix, loc.endpoint, loc.region) == (
        "kv", "cluster-a", "http://minio:9000", "eu-west-1"
    )  # fmt: skip
    assert loc.key("abc", "1.kvb") == "cluster-a/abc/1.kvb" and loc.url == "s3://kv/cluster-a"
    assert S3Location.parse("s3://kv").key("x") == "x"
    assert S3Location.parse("s3://kv").endpoint == "https://s3.eu-west-1.amazonaws.com"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "https://objects.example:8443")
    assert S3Location.parse("s3://kv/p").endpoint == "https://objects.example:8443"


@pytest.mark.parametrize(
    ("url", "endpoint", "field"),
    [("/data/kv", None, "shared_kv_path"), ("s3://", None, "shared_kv_path"),
     ("s3://kv/p", "minio:9000", "shared_kv_endpoint")],
)  # fmt: skip
def test_a_bad_location_is_refused_naming_the_field(url, endpoint, field):
    with pytest.raises(ValueError, match=field):
        S3Location.parse(url, endpoint)


def test_the_cache_config_takes_an_object_store_and_refuses_a_stray_endpoint(tmp_path):
    assert is_object_store("s3://kv/p") and not is_object_store(str(tmp_path))
    disk = {"disk_kv_cache_bytes": 1 << 20, "disk_kv_path": str(tmp_path / "disk")}
    CacheConfig(shared_kv_cache_bytes=1 << 20, shared_kv_path="s3://kv/p", **disk)
    with pytest.raises(ValueError, match="shared_kv_endpoint needs an object store"):
        CacheConfig(
            shared_kv_cache_bytes=1 << 20,
            shared_kv_path=str(tmp_path / "shared"),
            shared_kv_endpoint="http://minio:9000",
            **disk,
        )
