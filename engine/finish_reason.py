"""FinishReason: why a request (or one of its choices) ended; a str enum, torch-free, so the
engine, the workers and the router share it and it pickles as itself. Holds no state."""

from __future__ import annotations

import enum


class FinishReason(enum.StrEnum):
    """Its value is the string the OpenAI API answers with (HTTP finish_reason, metrics label);
    proto/kvrelay.proto's FinishReason has a value for each a client can see."""

    STOP = "stop"  # eos, a stop token, a stop string or a completed grammar
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # the client left, or the server ended the request (shutting down)
    # Never from an engine: a worker or the router failed the request (TokenDelta.error says
    # why); the router answers it as an error, not as a finished request.
    ERROR = "error"
    # Engine-side only (keep_blocks): the request ended at its first token and nothing else
    # ended it; the prefill worker reports no finish reason (decode goes on), so it never
    # reaches the router.
    FIRST_TOKEN = "first_token"
