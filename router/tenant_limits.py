"""TenantLimits: one tenant's per-key limits (requests per second, tokens per minute, concurrent
streams) as the API-key file's `rps=5 tpm=20000 streams=4` columns or the router's
--rate-limit-* flags give them; frozen values and their parsing, no state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

LIMIT_NAMES = ("rps", "tpm", "streams")
LIMIT_TITLES = {
    "rps": "requests per second",
    "tpm": "tokens per minute",
    "streams": "concurrent streams",
}


@dataclass(frozen=True)
class TenantLimits:
    """None: no limit of that kind. rps may be fractional (0.5: one request each 2 s)."""

    rps: float | None = None
    tpm: int | None = None
    streams: int | None = None

    def over(self, defaults: TenantLimits) -> TenantLimits:
        """These limits, each one not given taken from `defaults` (the router's flags)."""
        return TenantLimits(
            *(
                getattr(self, f.name)
                if getattr(self, f.name) is not None
                else getattr(defaults, f.name)
                for f in fields(self)
            )
        )

    @property
    def any(self) -> bool:
        return any(getattr(self, name) is not None for name in LIMIT_NAMES)

    def describe(self) -> str:
        """`rps=5 tpm=20000 streams=4` (the given ones), or `none`."""
        given = [f"{n}={getattr(self, n):g}" for n in LIMIT_NAMES if getattr(self, n) is not None]
        return " ".join(given) or "none"


NO_LIMITS = TenantLimits()


def check_limit(name: str, value: float | None) -> float | None:
    """`value` unless it is not a positive finite number (ValueError naming the limit); an
    integer for tpm and streams."""
    if value is None:
        return None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number, got {value:g}")
    if name != "rps" and value != int(value):
        raise ValueError(f"{name} must be a whole number, got {value:g}")
    return value if name == "rps" else int(value)


def limits_from_options(options: Mapping[str, str], where: str) -> TenantLimits:
    """The limits among a key line's `name=value` options (the caller refuses unknown names);
    ValueError `where: ...` naming the bad one."""
    values: dict[str, float | None] = {}
    for name in LIMIT_NAMES:
        text = options.get(name)
        if text is None:
            continue
        try:
            number = float(text)
        except ValueError:
            raise ValueError(f"{where}: {name}={text!r} is not a number") from None
        try:
            values[name] = check_limit(name, number)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return TenantLimits(**values)  # type: ignore[arg-type]
