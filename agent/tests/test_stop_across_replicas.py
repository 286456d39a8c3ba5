"""StopTurn at a replica that does not run the turn: two agent processes over one transcript and compaction.
The turn runs in this test's process; the stop goes to an agent in a process of its own, which fences the
turn's RUN claim. The running loop stops at its next renewal or write and stores what was shown as
interrupted, and writes nothing after."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from agent_testing import AgentStack, agent_process, running_agent

from continuum.transcript.v1 import resources_pb2 as tpb
from continuum_agent.model import message_text

QUESTION = "Please rename name to displayName everywhere"
RENEW_SECONDS = 1.0


def _roles(messages: Sequence[tpb.Message]) -> list[str]:
    return [tpb.MessageRole.Name(m.role).removeprefix("MESSAGE_ROLE_") for m in messages]


async def _until(agent: AgentStack, session_id: str, done: object, seconds: float = 30) -> list[tpb.Message]:
    """The session's messages once `done(messages)` holds; fail after `seconds`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while loop.time() < deadline:
        messages = await agent.messages(session_id)
        if done(messages):  # type: ignore[operator]
            return messages
        await asyncio.sleep(0.02)
    raise AssertionError(f"not reached within {seconds} s")


def _answer_streaming(messages: list[tpb.Message]) -> bool:
    return sum(m.role == tpb.MESSAGE_ROLE_TOOL for m in messages) == 2


def _answer_settled(messages: list[tpb.Message]) -> bool:
    last = messages[-1]
    return _answer_streaming(messages) and last.role == tpb.MESSAGE_ROLE_ASSISTANT and not last.tool_calls


async def test_a_stop_at_another_replica_stops_the_turn_and_stores_what_was_shown(
    tmp_path: Path, database_url: str
) -> None:
    # The answer takes seconds to write (about 35 words at 0.2 s), so the stop lands inside it.
    async with (
        running_agent(tmp_path, database_url, offline_delta_seconds=0.2, claim_renew_seconds=RENEW_SECONDS) as running,
        agent_process(running.services, tmp_path / "other", running.workdir) as (other, _),
    ):
        await running.new_session("s1")
        assert not await other.stop_turn("s1")  # nothing runs yet
        await running.start_turn("s1", QUESTION)
        await _until(running, "s1", _answer_streaming)
        await asyncio.sleep(0.5)

        loop = asyncio.get_running_loop()
        asked = loop.time()
        assert await other.stop_turn("s1")
        messages = await _until(running, "s1", _answer_settled)
        settled_after = loop.time() - asked

        # Nothing is written after the stop settled, and neither replica finds a turn to stop.
        await asyncio.sleep(RENEW_SECONDS * 2)
        assert await running.messages("s1") == messages
        assert not await running.stop_turn("s1")
        assert not await other.stop_turn("s1")
        # The session is free for the next turn, through either replica.
        await other.start_turn("s1", "again")
        await other.wait_idle("s1")

    assert _roles(messages) == ["USER", "ASSISTANT", "TOOL", "TOOL", "ASSISTANT"]
    shown = messages[-1]
    assert shown.status == tpb.MESSAGE_STATUS_INTERRUPTED
    assert message_text(shown).startswith("Here is")
    assert not message_text(shown).endswith("real answers.")
    # Noticed at the next renewal (a loaded machine adds a little).
    assert settled_after < RENEW_SECONDS + 3


async def test_a_stop_that_reaches_a_turn_between_rounds_commits_nothing_more(
    tmp_path: Path, database_url: str
) -> None:
    # Renewals far apart: only the claim check before a write can notice the fence in time.
    async with (
        running_agent(
            tmp_path, database_url, offline_delta_seconds=0.2, claim_renew_seconds=4.0, claim_ttl_seconds=30
        ) as running,
        agent_process(running.services, tmp_path / "other", running.workdir) as (other, _),
    ):
        await running.new_session("s1")
        await running.start_turn("s1", QUESTION)
        # The first reply ("Let me look at the working directory first.") is being written.
        await asyncio.sleep(0.5)
        assert await other.stop_turn("s1")
        messages = await _until(running, "s1", lambda found: found[-1].role == tpb.MESSAGE_ROLE_ASSISTANT)
        await asyncio.sleep(1.0)
        assert await running.messages("s1") == messages

    # The tool-calling reply was not committed whole, and no tool result followed it.
    assert _roles(messages) == ["USER", "ASSISTANT"]
    assert messages[-1].status == tpb.MESSAGE_STATUS_INTERRUPTED
    assert not messages[-1].tool_calls
