"""Cancellation never cuts a protected piece of work in half."""

from __future__ import annotations

import asyncio

import pytest

from continuum_runtime.cancellation import run_to_completion


async def test_a_cancelled_caller_returns_at_once_and_the_work_still_completes() -> None:
    done = asyncio.Event()

    async def work() -> None:
        await asyncio.sleep(0.05)
        done.set()

    caller = asyncio.create_task(run_to_completion(work()))
    await asyncio.sleep(0)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert not done.is_set()
    await asyncio.wait_for(done.wait(), 5)
