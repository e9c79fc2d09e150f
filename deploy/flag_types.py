"""argparse types of the numeric flags (ports, counts, sizes, durations) and the parser class whose
errors are one line: a bad value (a port past 65535, a negative count, nan or inf) is refused
while the command line is parsed, naming its flag, before anything starts. Holds no state."""

from __future__ import annotations

import argparse
import math
import sys
from typing import NoReturn

MAX_PORT = 65535


def port(text: str) -> int:
    """A TCP port, 1-65535, or 0: a free one the system picks."""
    value = _int(text)
    if not 0 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(
            f"must be a port in 1-{MAX_PORT} (0: a free one), got {value}"
        )
    return value


def add_http_port(p: argparse.ArgumentParser, help: str, default: int = 8000) -> None:
    """--http-port, also taken as vLLM's --port (dest http_port, a port())."""
    p.add_argument("--http-port", "--port", dest="http_port", type=port, default=default, help=help)


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (nan and inf refused)."""
    value = _float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value:g}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (nan and inf refused)."""
    value = _float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value:g}")
    return value


def finite_float(text: str) -> float:
    """Any finite number (nan and inf refused); its range is the flag's own check."""
    return _float(text)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants a whole number, got {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


class OneLineErrors(argparse.ArgumentParser):
    """A (sub)command parser whose error is one line naming the flag, exit status 2, instead of
    argparse's usage (dozens of lines for `kvrelay serve`) before it; --help still shows it."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)
