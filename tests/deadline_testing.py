"""Waits that fail with a message instead of hanging (importable as `deadline_testing`).

A test waiting for something that never comes (a dropped frame, a missing resync, a stream that
never ends, a process that never starts) must fail at its own deadline saying what it waited for
and what it saw, not sit until pytest's global timeout kills it with a stack dump. These are the
only waiting helpers the suites use: `deadline`/`within` for one awaitable, `eventually` to poll a
condition from async code, `wait_for` to poll one from sync code.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
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


async def eventually(
    check: Callable[[], object],
    *,
    what: str | Callable[[], str] | None = None,
    seconds: float = 10.0,
    interval: float = 0.01,
) -> None:
    """Poll `check()` (plain or async) until it is truthy, or fail naming `what` (a callable is asked
    on failure; by default the check's own place in the source). For conditions with nothing to
    await: a counter, a log record, a row another process writes. An exception from `check` fails
    at once."""
    async with deadline(seconds, what or _where(check)):
        while True:
            result = check()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return
            await asyncio.sleep(interval)


def wait_for(
    condition: Callable[[], bool],
    *,
    what: str,
    seconds: float,
    diagnostics: Callable[[], str] | None = None,
    interval: float = 0.05,
) -> None:
    """Poll `condition()` from sync code (a subprocess's files, a supervisor's output) until true, or
    fail naming `what`, with `diagnostics()` (say, the process's output) appended."""
    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > end:
            detail = f"\n{diagnostics()}" if diagnostics is not None else ""
            raise AssertionError(f"waited {seconds:g} s in vain for {what}{detail}")
        time.sleep(interval)


def _where(check: Callable[[], object]) -> str:
    code = getattr(check, "__code__", None)
    if code is None:
        return repr(check)
    return f"the condition on line {code.co_firstlineno} of {Path(code.co_filename).name}"
