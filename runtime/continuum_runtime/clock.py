"""Time as a dependency: every component is handed a `Clock`, so lease and expiry logic can be
tested by moving time instead of waiting for it."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    """Wall-clock and monotonic time, and waiting."""

    def now_ms(self) -> int:
        """Current UTC time in epoch milliseconds, the unit every table stores."""
        ...

    def monotonic(self) -> float:
        """Seconds from an arbitrary origin that never goes backwards, for durations."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds` of this clock's time."""
        ...


class SystemClock:
    """The real clocks of the machine."""

    def now_ms(self) -> int:
        """Current UTC time in epoch milliseconds."""
        return time.time_ns() // 1_000_000

    def monotonic(self) -> float:
        """`time.monotonic()`."""
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        """`asyncio.sleep(seconds)`."""
        await asyncio.sleep(seconds)
