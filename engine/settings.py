"""Settings: the choices a user makes through KVRELAY_* environment variables, as one frozen
object; owns no state. This is the only module that reads them.

Settings.from_env() parses each variable one way (on/off: "0" or "1"; a folder: a non-empty
path) and refuses a bad value naming the variable and what it accepts, and any KVRELAY_*
variable it does not know, listing the ones it does: a removed experiment's switch (say
KVRELAY_FP8_SPLIT_K=1) is refused, not silently ignored. EngineConfig builds its settings from
the environment once, where it is constructed (the driver), and carries them to Ray workers, so
a worker runs with the driver's settings rather than its own environment; the engine logs
describe() when it starts.

Every kernel or tuning choice a GPU run showed to win is the engine's default with no switch,
and what never won was deleted (docs/gpu.md). What is left is what a user really chooses:
  fp8_fast_accum  KVRELAY_FP8_FAST_ACCUM  cuBLASLt's FP8 GEMMs accumulate in Hopper's fast mode
                  (default 1); 0: exactly, ~5% slower GEMMs, outputs within ~1% of the largest.
  cpu_kernel      KVRELAY_CPU_KERNEL      the C++ CPU paged-decode kernel (default 1); 0: plain
                  torch ops, for a machine where it cannot be built.
  cache_dir       KVRELAY_CACHE_DIR       where GGUF checkpoints are converted once, and the
                  object store's plugin stand-in is built (default ~/.cache/kvrelay).
  state_dir       KVRELAY_STATE_DIR       where `kvrelay serve` records its cluster's address
                  (default /tmp/kvrelay-<uid>).
UCX_TLS is UCX's own variable, not one of these: kvtransfer/nixl_agent.py respects a user's
value where each NIXL agent starts, since UCX reads its own process's environment.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

PREFIX = "KVRELAY_"


class SettingsError(ValueError):
    """A KVRELAY_* variable with a bad value, or one kvrelay does not know."""


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "kvrelay"


def default_state_dir() -> Path:
    return Path(f"/tmp/kvrelay-{os.getuid()}")


def on_off(name: str, raw: str) -> bool:
    value = raw.strip()
    if value not in ("0", "1"):
        raise SettingsError(f"{name} must be 0 or 1, got {raw!r}")
    return value == "1"


def folder(name: str, raw: str) -> Path:
    value = raw.strip()
    if not value:
        raise SettingsError(f"{name} must be a folder path, got {raw!r}")
    return Path(value).expanduser()


class Variable(NamedTuple):
    """One environment variable: the Settings field it sets and how its value is parsed."""

    field: str
    name: str
    parse: Callable[[str, str], Any]  # (name, raw value) -> the field's value


VARIABLES = (
    Variable("fp8_fast_accum", "KVRELAY_FP8_FAST_ACCUM", on_off),
    Variable("cpu_kernel", "KVRELAY_CPU_KERNEL", on_off),
    Variable("cache_dir", "KVRELAY_CACHE_DIR", folder),
    Variable("state_dir", "KVRELAY_STATE_DIR", folder),
)
KNOWN = tuple(v.name for v in VARIABLES)


@dataclass(frozen=True)
class Settings:
    """What the user chose (see the module docstring); Settings() is every default."""

    fp8_fast_accum: bool = True
    cpu_kernel: bool = True
    cache_dir: Path = field(default_factory=default_cache_dir)
    state_dir: Path = field(default_factory=default_state_dir)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings of environ (default os.environ): unset variables keep their defaults;
        a bad value or an unknown KVRELAY_* variable raises SettingsError naming it."""
        environ = os.environ if environ is None else environ
        unknown = sorted(k for k in environ if k.startswith(PREFIX) and k not in KNOWN)
        if unknown:
            raise SettingsError(
                f"unknown kvrelay setting{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(unknown)}; the known ones are {', '.join(KNOWN)} (docs/gpu.md: "
                "removed experiments' switches are refused, not ignored)"
            )
        given = {v.field: v.parse(v.name, environ[v.name]) for v in VARIABLES if v.name in environ}
        return cls(**given)

    def describe(self) -> str:
        """One log line: every setting by its variable's name, with its value."""
        values = ((v.name, getattr(self, v.field)) for v in VARIABLES)
        return "settings: " + " ".join(
            f"{name}={int(value) if isinstance(value, bool) else value}" for name, value in values
        )
