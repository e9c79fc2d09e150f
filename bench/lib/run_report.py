"""The header every in-process bench report starts with (how it was run, where, when) and its
JSON file; stateless."""

from __future__ import annotations

import json
import platform
from datetime import UTC, datetime
from typing import Any

import torch


def report_header(command: str) -> dict[str, Any]:
    """command: how the run was started (`python -m bench.X ...`)."""
    return {
        "command": command,
        "machine": platform.platform(),
        "torch": torch.__version__,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def write_report(path: str | None, report: dict[str, Any]) -> None:
    """Write the report as indented JSON to path (nothing when path is None)."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
