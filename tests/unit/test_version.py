"""common/version.py: an uninstalled checkout (the GPU machine's staged snapshot) still has a
version, so the HTTP server's OpenAPI document and `kvrelay --version` build there."""

from __future__ import annotations

from importlib import metadata

import pytest

from common import version as version_module
from router.openapi import openapi_document


def test_a_checkout_never_installed_has_a_version(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(version_module.metadata, "version", missing)
    assert version_module.version() == version_module.UNINSTALLED
    assert openapi_document(version_module.version())["info"]["version"] == "0+checkout"


def test_an_installed_kvrelay_reports_its_distribution_version() -> None:
    assert version_module.version() == metadata.version("kvrelay")
