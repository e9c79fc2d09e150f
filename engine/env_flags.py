"""Reading the engine's on/off settings from the environment ("0" or "1", anything else refused
with an error naming the variable); owns no state."""

from __future__ import annotations

import os


def on_off(name: str, default: bool) -> bool:
    """The setting `name` ("0" or "1", surrounding spaces ignored; unset: default)."""
    raw = os.environ.get(name, "1" if default else "0").strip()
    if raw not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {raw!r}")
    return raw == "1"
