"""say(): the engine's one-line messages on stderr (start-up, warm-up, what it chose); owns no
state."""

from __future__ import annotations

import sys


def say(message: str) -> None:
    print(f"kvrelay engine: {message}", file=sys.stderr, flush=True)
