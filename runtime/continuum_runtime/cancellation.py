"""Work that a cancellation must not cut in half.

A coroutine cancelled between two database statements can leave half of its work done; one cancelled
inside a statement costs its pooled connection (the pool closes it and opens another).
`run_to_completion` protects a unary RPC whose client went away: the work goes on in its own task
and its answer is dropped; the caller returns at once (gRPC does not wait for a cancelled handler).
`finish_before_stopping` protects a short database step of a stream or a background loop from the
caller's cancel: the cancel waits for the step (a second cancel ends the wait; the step still runs to
its end, and `Database.dispose` waits for its connection). A step's refusal (`ServiceError`) that
nobody waits for any more is dropped quietly; any other failure is logged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

from continuum_runtime.errors import ServiceError

T = TypeVar("T")

logger = logging.getLogger("continuum.cancellation")


async def run_to_completion(call: Awaitable[T], *, expected: tuple[type[BaseException], ...] = ()) -> T:
    """Await `call` in its own task, so that cancelling the caller does not stop it halfway; a cancelled
    caller's answer is dropped. A failure nobody waits for any more is logged with its frames unless it
    is a refusal or one of the `expected` kinds."""
    task = asyncio.ensure_future(call)
    # What asyncio.shield does, with one callback less per call (every unary call of transcript
    # passes here): the caller waits on a future of its own, which a cancel cancels instead of the
    # task; the task's end completes it.
    finished: asyncio.Future[None] = task.get_loop().create_future()

    def end(_: asyncio.Future[T]) -> None:
        if not finished.done():
            finished.set_result(None)

    task.add_done_callback(end)
    try:
        await finished
    except asyncio.CancelledError:
        task.add_done_callback(lambda done: _log_dropped(done, expected))
        raise
    return task.result()


async def finish_before_stopping(call: Awaitable[T]) -> T:
    """Await `call` in its own task; when the caller is cancelled meanwhile, let `call` end first, then
    stop (for short database steps of a loop that is stopped by cancelling it)."""
    task = asyncio.ensure_future(call)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        _log_dropped(task, ())  # the stop goes on; a failure of the step is logged, not lost
        raise


def _log_dropped(task: asyncio.Future[Any], expected: tuple[type[BaseException], ...]) -> None:
    if task.cancelled():
        return
    error = task.exception()
    if error is not None and not isinstance(error, (ServiceError, *expected)):
        logger.error("work failed after its caller went away", exc_info=error)
