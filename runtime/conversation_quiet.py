"""When the conversation cache's background threads may work: while no request computes, and
once none has for a moment.

Why: a coding agent sends its next request right after a reply (a quick tool's result, a title
request, the next subagent turn). The reserve's thread and the writer work a piece at a time (a
pinned slab registered, a file hashed, written and fsynced), and a piece begun just before that
request runs beside it to its end: a turn that came back to back after a long one took longer
than a plain turn with that work beside it (BENCHMARKS.md, issue 42). Waiting ``CALM_SECONDS``
after the last request lets such a burst through first; an agent's tools, its user's reading and
typing leave longer gaps, in which the work is done.
"""
from __future__ import annotations

import threading
import time

CALM_SECONDS = 0.3  # longer than an agent's back-to-back gap (its HTTP round trip, a quick tool)


class Quiet:
    """An event set while no request computes, whose ``wait`` returns only once it has been set
    for ``calm`` seconds in a row (a request that begins meanwhile clears it)."""

    def __init__(self, calm: float = CALM_SECONDS):
        self.calm = calm
        self._event = threading.Event()
        self._since = 0.0  # when it was last set (monotonic seconds)
        self.set(at_once=True)

    def set(self, at_once: bool = False) -> None:
        """No request computes from now on; ``at_once``: the threads may work without waiting for
        the calm (the engine itself waits for them: ``FolderTier.wait_for_writes``, ``close``)."""
        self._since = -float("inf") if at_once else time.monotonic()
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self) -> None:
        """Until no request has computed for ``calm`` seconds (or the event was set ``at_once``)."""
        while True:
            self._event.wait()
            left = self._since + self.calm - time.monotonic()
            if left > 0:
                time.sleep(left)  # (set again meanwhile: the calm starts over; cleared: wait again)
            elif self._event.is_set():
                return
