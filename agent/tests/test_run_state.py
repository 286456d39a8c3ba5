"""The session's runtime state as every follower sees it: RUNNING with the user message, before any answer
streams, and IDLE when the turn ends, however it ends. A real transcript, compaction and agent."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from agent_testing import AgentStack, running_agent
from compaction_testing import OWNER

from continuum.transcript.v1 import follow_pb2 as fpb
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as tapi

RUNNING = fpb.RUN_STATE_RUNNING
IDLE = fpb.RUN_STATE_IDLE


class Watcher:
    """A raw Follow stream of one session, as a browser's follower reads it."""

    def __init__(self, agent: AgentStack, session_id: str) -> None:
        request = tapi.FollowRequest(session_id=session_id, capabilities=["transcript-v2"])
        self.call = agent.services.transcript.stub.Follow(request, metadata=agent.user(OWNER))
        self.frames: list[tapi.FollowResponse] = []

    async def until(self, found: Callable[[tapi.FollowResponse], bool], seconds: float = 30.0) -> tapi.FollowResponse:
        """Read frames until `found(frame)`; that frame."""
        async with asyncio.timeout(seconds):
            while True:
                frame = await self.call.read()
                assert isinstance(frame, tapi.FollowResponse), "the Follow stream ended"
                self.frames.append(frame)
                if found(frame):
                    return frame

    async def state(self, wanted: int, seconds: float = 30.0) -> tapi.FollowResponse:
        """The next frame that sets the runtime state to `wanted` (the snapshot's included)."""

        def sets(frame: tapi.FollowResponse) -> bool:
            kind = frame.WhichOneof("frame")
            if kind == "snapshot_runtime":
                return frame.snapshot_runtime.runtime_state.state == wanted
            return (
                kind == "batch" and frame.batch.HasField("runtime_state") and frame.batch.runtime_state.state == wanted
            )

        return await self.until(sets, seconds)

    def close(self) -> None:
        """Disconnect."""
        self.call.cancel()


async def left_running(agent: AgentStack, session_id: str) -> None:
    """What an agent killed mid-turn leaves: RUNNING of run "run-killed" (its claim lapsed)."""
    stale = fpb.RuntimeState(state=RUNNING, run_id="run-killed")
    await agent.services.transcript.stub.PublishBatch(
        tapi.PublishBatchRequest(session_id=session_id, operations=[tapi.BatchOperation(runtime_state=stale)]),
        metadata=agent.user(OWNER),
    )


async def a_stop_clears_the_stale_running(agent: AgentStack, watcher: Watcher, session_id: str) -> None:
    """The RUNNING `left_running` published is seen; a stop finds no turn of its own and publishes IDLE."""
    assert _state(await watcher.state(RUNNING)).run_id == "run-killed"

    assert not await agent.stop_turn(session_id)

    idle = await watcher.state(IDLE)
    assert dict(idle.batch.runtime_state.details) == {"outcome": "stopped"}


def _state(frame: tapi.FollowResponse) -> fpb.RuntimeState:
    return frame.batch.runtime_state if frame.WhichOneof("frame") == "batch" else frame.snapshot_runtime.runtime_state


async def test_a_turn_is_running_with_its_user_message_and_idle_after_its_answer(agent: AgentStack) -> None:
    await agent.new_session("s1")
    watcher = Watcher(agent, "s1")
    await watcher.until(lambda f: f.WhichOneof("frame") == "snapshot_end")
    try:
        started = await agent.start_turn("s1", "look around")

        running = await watcher.state(RUNNING)
        # One batch: the user message and RUNNING with the run id, before any attempt opens.
        assert [m.message_id for m in running.batch.messages] == [started.user_message_id]
        assert running.batch.runtime_state.run_id == started.run_id
        assert running.batch.runtime_state.details["model"] == "offline"
        assert all(f.WhichOneof("frame") != "attempt_opened" for f in watcher.frames)

        idle = await watcher.state(IDLE)
        assert dict(idle.batch.runtime_state.details) == {"outcome": "completed", "lastRunId": started.run_id}
        assert idle.batch.runtime_state.run_id == ""
        kinds = [f.WhichOneof("frame") for f in watcher.frames]
        # The answer was committed (and settled) before the turn said it ended.
        assert kinds.index("settlement") < len(kinds) - 1
    finally:
        watcher.close()
    await agent.wait_idle("s1")

    # A follower that comes later gets IDLE in its snapshot.
    late = Watcher(agent, "s1")
    try:
        assert _state(await late.state(IDLE)).details["outcome"] == "completed"
    finally:
        late.close()


async def test_a_stopped_turn_ends_idle_and_a_turn_whose_claim_was_taken_still_ends_idle(
    tmp_path: Path, database_url: str
) -> None:
    async with running_agent(
        tmp_path, database_url, offline_delta_seconds=0.1, claim_renew_seconds=0.2, claim_ttl_seconds=3
    ) as agent:
        await agent.new_session("s1")
        watcher = Watcher(agent, "s1")
        try:
            started = await agent.start_turn("s1", "first")
            await watcher.state(RUNNING)
            assert await agent.stop_turn("s1")
            idle = await watcher.state(IDLE)
            assert dict(idle.batch.runtime_state.details) == {"outcome": "stopped", "lastRunId": started.run_id}

            # An operator frees the session under a running turn: the turn stops at its next renewal and
            # still publishes IDLE, under a claim taken for that write.
            second = await agent.start_turn("s1", "second")
            await watcher.state(RUNNING)
            await agent.services.transcript.stub.ReleaseHolderClaims(
                tapi.ReleaseHolderClaimsRequest(holder=second.run_id, kind=tpb.CLAIM_KIND_RUN),
                metadata=agent.services.transcript.system,
            )
            idle = await watcher.state(IDLE)
            assert dict(idle.batch.runtime_state.details) == {"outcome": "stopped", "lastRunId": second.run_id}
        finally:
            watcher.close()
        await agent.wait_idle("s1")


async def test_a_failed_turn_ends_idle_saying_so(tmp_path: Path, database_url: str) -> None:
    async with running_agent(tmp_path, database_url, compaction_address="127.0.0.1:1") as agent:
        await agent.new_session("s1")
        watcher = Watcher(agent, "s1")
        try:
            started = await agent.start_turn("s1", "hello")
            idle = await watcher.state(IDLE)
            assert dict(idle.batch.runtime_state.details) == {"outcome": "failed", "lastRunId": started.run_id}
        finally:
            watcher.close()
        await agent.wait_idle("s1")


async def test_a_stop_with_no_turn_running_clears_a_running_state_a_killed_agent_left(agent: AgentStack) -> None:
    await agent.new_session("s1")
    await left_running(agent, "s1")
    watcher = Watcher(agent, "s1")
    try:
        await a_stop_clears_the_stale_running(agent, watcher, "s1")
    finally:
        watcher.close()
    # The claim taken for that write is released.
    await agent.wait_idle("s1", within_seconds=1)


async def test_a_stop_leaves_the_state_of_a_turn_that_holds_the_session_alone(agent: AgentStack) -> None:
    await agent.new_session("s1")
    claim_id = await agent.try_claim("s1", holder="run-elsewhere")
    assert claim_id is not None
    running = fpb.RuntimeState(state=RUNNING, run_id="run-elsewhere")
    await agent.services.transcript.stub.PublishBatch(
        tapi.PublishBatchRequest(session_id="s1", operations=[tapi.BatchOperation(runtime_state=running)]),
        metadata=agent.user(OWNER),
    )
    # Another runtime's turn: this agent finds no run of its own in the messages, and must not say IDLE.
    assert not await agent.stop_turn("s1")
    watcher = Watcher(agent, "s1")
    try:
        snapshot = await watcher.until(lambda f: f.WhichOneof("frame") == "snapshot_runtime")
        assert snapshot.snapshot_runtime.runtime_state.state == RUNNING
    finally:
        watcher.close()
        await agent.release(claim_id)


@pytest.mark.parametrize("kind", [tpb.CLAIM_KIND_MERGE, tpb.CLAIM_KIND_COMPACTION], ids=["merge", "compaction"])
async def test_a_stop_while_a_merge_or_compaction_holds_the_session_still_publishes_idle(
    agent: AgentStack, kind: int
) -> None:
    """No turn can run while a merge or compaction holds the session, so the RUNNING a killed agent left is
    stale: a stop publishes IDLE without a claim of its own (it cannot take one) and takes nothing."""
    await agent.new_session("s1")
    await left_running(agent, "s1")
    claim_id = await agent.try_claim("s1", holder="op-holding", ttl_seconds=30, kind=kind)
    assert claim_id is not None
    watcher = Watcher(agent, "s1")
    try:
        await a_stop_clears_the_stale_running(agent, watcher, "s1")
        # The merge's or compaction's claim is untouched: a RUN claim still cannot be taken.
        assert await agent.try_claim("s1") is None
    finally:
        watcher.close()
        await agent.release(claim_id)
