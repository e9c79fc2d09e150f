"""StopChecker: one request's incremental text and stop-string matching (torch-free: the router
uses it too).

Only a tail of the text that could still turn out to be the start of a stop string is held
back, so a stop string never leaks into the output, even when it spans several tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.tokenizer import Decoder, IncrementalDetokenizer


class StopChecker:
    def __init__(self, tokenizer: Decoder, stop: Sequence[str] = ()):
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.num_emitted = 0  # characters of detokenizer.text already returned
        self.matched: str | None = None

    @property
    def text(self) -> str:
        """Output text so far (cut before the stop string once one matched)."""
        return self.detokenizer.text[: self.num_emitted] if self.matched else self.detokenizer.text

    def add(self, token_id: int) -> str:
        """Feed one token; return text that is now safe to emit."""
        if self.matched is not None:
            return ""
        delta = self.detokenizer.add([token_id])
        text = self.detokenizer.text
        if delta and self.stop:
            start = max(0, len(text) - len(delta) - self.hold)
            hits = [(pos, s) for s in self.stop if (pos := text.find(s, start)) >= 0]
            if hits:
                pos, self.matched = min(hits)
                return self._emit_until(pos)
        return self._emit_until(len(text) - self._partial_stop_len(text))

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest tail of text that a stop string starts with (held back)."""
        for size in range(min(self.hold, len(text)), 0, -1):
            tail = text[-size:]
            if any(s.startswith(tail) for s in self.stop):
                return size
        return 0

    def finish(self) -> str:
        """The request ended for another reason: release the held-back tail."""
        if self.matched is not None:
            return ""
        self.detokenizer.flush()
        return self._emit_until(len(self.detokenizer.text))

    def _emit_until(self, end: int) -> str:
        if end <= self.num_emitted:
            return ""
        out = self.detokenizer.text[self.num_emitted : end]
        self.num_emitted = end
        return out
