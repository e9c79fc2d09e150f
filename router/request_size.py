"""The largest request body a router reads (HTTP and gRPC alike): --max-body-mib when given, else
derived from the context length. Holds no state."""

from __future__ import annotations

MIB = 2**20
MAX_BODY_MIB = 2047  # gRPC's message limit is a 32-bit int
MIN_DEFAULT_BODY_BYTES = 4 * MIB
# A prompt filling the context, written as JSON: ~4 bytes of text a token, up to 6x that in
# escapes (or ~7 bytes a token id), plus the rest of the body; 32 leaves room for all of it.
BODY_BYTES_PER_CONTEXT_TOKEN = 32


def check_max_body_mib(max_body_mib: float | None) -> None:
    """ValueError naming the flag unless it is None or a number in (0, 2047]."""
    if max_body_mib is not None and not 0 < max_body_mib <= MAX_BODY_MIB:  # NaN too
        raise ValueError(f"--max-body-mib must be in (0, {MAX_BODY_MIB}], got {max_body_mib}")


def max_body_bytes(max_model_len: int, max_body_mib: float | None = None) -> int:
    """max_body_mib in bytes; None: 32 bytes a token of context, at least 4 MiB."""
    check_max_body_mib(max_body_mib)
    if max_body_mib is not None:
        return max(1, int(max_body_mib * MIB))
    derived = max(MIN_DEFAULT_BODY_BYTES, BODY_BYTES_PER_CONTEXT_TOKEN * max_model_len)
    return min(derived, MAX_BODY_MIB * MIB)
