"""Waits that fail with a message instead of hanging (importable as `deadline_testing`).

A test waiting for something that never comes (a dropped frame, a missing resync, a stream that
never ends) must fail at its own deadline saying what it waited for and what it saw, not sit until
pytest's global timeout kills it with a stack dump.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

T = TypeVar("T")


@asynccontextmanager
async def deadline(seconds: float, waiting_for: str | Callable[[], str]) -> AsyncIterator[None]:
    """Fail with an AssertionError unless the block ends within `seconds`.

    `waiting_for` says what the block waits for; a callable is asked only on failure, so it can
    describe what arrived until then.
    """
    scope = asyncio.timeout(seconds)
    try:
        async with scope:
            yield
    except TimeoutError:
        if not scope.expired():
            raise  # a timeout of something inside the block, not of this deadline
        described = waiting_for() if callable(waiting_for) else waiting_for
        raise AssertionError(f"waited {seconds:g} s in vain for {described}") from None


async def within(awaitable: Awaitable[T], seconds: float, waiting_for: str | Callable[[], str]) -> T:
    """`await awaitable`, failing with an AssertionError naming `waiting_for` after `seconds`."""
    async with deadline(seconds, waiting_for):
        return await awaitable
