"""The one time budget of a HandoffRead call: verification, directory and body reads all spend it.

Time comes from the injected `Clock`, so tests move it instead of waiting. The package reader checks
the deadline between buffers and files; the service may cancel it when its caller went away.
"""

from __future__ import annotations

import threading

from continuum_handoff_read.errors import BudgetExceeded
from continuum_runtime.clock import Clock

# Seed 000 §7.2: one 15 s deadline per call.
CALL_SECONDS = 15.0


class Deadline:
    """A point on `clock`'s monotonic time after which the call must stop; thread-safe to read."""

    def __init__(self, clock: Clock, seconds: float = CALL_SECONDS) -> None:
        self._clock = clock
        self._end = clock.monotonic() + seconds
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Stop the call at its next check (the caller is gone)."""
        self._cancelled.set()

    def cancelled(self) -> bool:
        """Whether the call was cancelled (its caller went away), rather than out of time."""
        return self._cancelled.is_set()

    def expired(self) -> bool:
        """Whether the time is up or the call was cancelled."""
        return self._cancelled.is_set() or self._clock.monotonic() >= self._end

    def remaining(self) -> float:
        """Seconds left (never negative; zero once cancelled)."""
        if self._cancelled.is_set():
            return 0.0
        return max(0.0, self._end - self._clock.monotonic())

    def check(self, doing: str) -> None:
        """Raise BudgetExceeded, saying what could not finish, once the deadline has passed."""
        if self.expired():
            raise BudgetExceeded(f"the call's time budget ran out while {doing}")
