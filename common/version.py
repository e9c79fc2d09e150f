"""kvrelay's version string: the installed distribution's, or a marker for a bare checkout."""

from __future__ import annotations

from importlib import metadata

UNINSTALLED = "0+checkout"  # PEP 440, so OpenAPI and --version readers can still parse it


def version() -> str:
    """The installed kvrelay's version; UNINSTALLED when run from a checkout never pip-installed
    (the GPU machine's staged snapshot, PYTHONPATH runs)."""
    try:
        return metadata.version("kvrelay")
    except metadata.PackageNotFoundError:
        return UNINSTALLED
