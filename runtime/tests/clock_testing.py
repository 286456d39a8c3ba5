"""A clock that moves only when a test says so (importable as `clock_testing`)."""

from __future__ import annotations

import asyncio

# 2024-01-01T00:00:00Z: a plausible wall-clock start, so stored times look like real ones.
START_MS = 1_704_067_200_000


class ManualClock:
    """Implements `continuum_runtime.clock.Clock`; `advance()` moves both clocks and wakes sleepers."""

    def __init__(self, start_ms: int = START_MS) -> None:
        self._now_ms = start_ms
        self._monotonic = 0.0
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def now_ms(self) -> int:
        """The wall-clock time the test has advanced to."""
        return self._now_ms

    def monotonic(self) -> float:
        """Seconds advanced since this clock was made."""
        return self._monotonic

    async def sleep(self, seconds: float) -> None:
        """Return once the test has advanced this clock by `seconds` (at once when not positive)."""
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        wake = asyncio.get_running_loop().create_future()
        entry = (self._monotonic + seconds, wake)
        self._sleepers.append(entry)
        try:
            await wake
        finally:
            if entry in self._sleepers:
                self._sleepers.remove(entry)

    @property
    def sleepers(self) -> int:
        """How many tasks are waiting in `sleep()` (a test waits for a loop to park before advancing)."""
        return len(self._sleepers)

    def advance(self, seconds: float) -> None:
        """Move time forward; every sleeper whose time has come is woken."""
        self._now_ms += round(seconds * 1000)
        self._monotonic += seconds
        due = [entry for entry in self._sleepers if entry[0] <= self._monotonic]
        for entry in due:
            self._sleepers.remove(entry)
            if not entry[1].done():
                entry[1].set_result(None)
