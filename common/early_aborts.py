"""EarlyAborts: a worker's record of the aborts that found nothing to abort, so that the call
they were meant for (a prefill, or a decode worker's submit), if it comes after them, does
nothing: computes no prompt, leases no blocks, decodes nothing.

Ray runs an async actor's calls in any order: a router that gives up on a request (its stream
ended, the client left) sends abort(req_id) right after the call, and when both wait for the
worker (a busy or stopped process) the abort may run first. Each entry is kept keep_s (a
prefill worker's lease length: a call later than that would lease its blocks no longer than any
unread lease lives) and at most max_entries are kept, the oldest dropped first. Engine thread
only.
"""

from __future__ import annotations

from collections import OrderedDict


class EarlyAborts:
    def __init__(self, keep_s: float, max_entries: int = 4096) -> None:
        self.keep_s = keep_s
        self.max_entries = max_entries
        self._aborted: OrderedDict[str, float] = OrderedDict()  # req_id -> when, oldest first

    def add(self, req_id: str, now: float) -> None:
        """An abort of req_id found no request, lease or waiting call to end."""
        self._prune(now)
        self._aborted[req_id] = now
        self._aborted.move_to_end(req_id)
        while len(self._aborted) > self.max_entries:
            self._aborted.popitem(last=False)

    def take(self, req_id: str, now: float) -> bool:
        """True when req_id's abort came before this call for it (the entry is used up)."""
        self._prune(now)
        return self._aborted.pop(req_id, None) is not None

    def __len__(self) -> int:
        return len(self._aborted)

    def _prune(self, now: float) -> None:
        while self._aborted:
            req_id, at = next(iter(self._aborted.items()))
            if now - at < self.keep_s:
                return
            del self._aborted[req_id]
