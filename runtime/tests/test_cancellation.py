"""Cancellation never cuts a protected piece of work in half."""

from __future__ import annotations

import asyncio

import pytest

from continuum_runtime.cancellation import finish_before_stopping, run_to_completion
from continuum_runtime.errors import InvalidArgument


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


async def test_a_stopped_loop_waits_for_its_step_to_finish_then_stops() -> None:
    release = asyncio.Event()
    steps: list[str] = []

    async def step() -> int:
        steps.append("begun")
        await release.wait()
        steps.append("finished")
        return 1

    loop = asyncio.create_task(finish_before_stopping(step()))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    loop.cancel()
    await asyncio.sleep(0.01)
    # The stop is asked for; the step is not cut: the loop is still waiting for it.
    assert not loop.done() and steps == ["begun"]
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(loop, 5)
    assert steps == ["begun", "finished"]


async def test_a_waiting_caller_gets_the_answer_or_the_failure() -> None:
    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    async def fail() -> int:
        await asyncio.sleep(0)
        raise ValueError("broken")

    assert await run_to_completion(answer()) == 42
    with pytest.raises(ValueError, match="broken"):
        await run_to_completion(fail())


@pytest.mark.parametrize("expected", [(), (ValueError,)])
async def test_a_failure_after_the_caller_left_is_logged_unless_expected(
    caplog: pytest.LogCaptureFixture, expected: tuple[type[BaseException], ...]
) -> None:
    release = asyncio.Event()
    failed = asyncio.Event()

    async def work() -> None:
        await release.wait()
        failed.set()
        raise ValueError("broken")

    caller = asyncio.create_task(run_to_completion(work(), expected=expected))
    await asyncio.sleep(0)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    release.set()
    await asyncio.wait_for(failed.wait(), 5)
    # The task's done callbacks run on the next turns of the loop.
    for _ in range(3):
        await asyncio.sleep(0)
    logged = [record for record in caplog.records if record.name == "continuum.cancellation"]
    assert len(logged) == (0 if expected else 1)


@pytest.mark.parametrize(
    ("failure", "logs"), [(ValueError("broken"), 1), (InvalidArgument("session_id", "is malformed"), 0)]
)
async def test_a_step_failing_after_its_loop_was_stopped_is_logged_unless_a_refusal_and_the_stop_goes_on(
    caplog: pytest.LogCaptureFixture, failure: Exception, logs: int
) -> None:
    release = asyncio.Event()

    async def step() -> None:
        await release.wait()
        raise failure

    loop = asyncio.create_task(finish_before_stopping(step()))
    await asyncio.sleep(0.01)
    loop.cancel()
    await asyncio.sleep(0.01)
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(loop, 5)
    logged = [record for record in caplog.records if record.name == "continuum.cancellation"]
    assert len(logged) == logs and all(record.exc_info is not None for record in logged)
