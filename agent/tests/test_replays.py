"""StartTurn retries the answering process does not remember: after a restart, and at another replica while
the first call's turn still runs. The first call's user message keeps the id; the retry finds it."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from agent_testing import replica, running_agent
from compaction_testing import RecordingProxy
from transcript_testing import append, assistant, user

from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as tapi
from continuum_agent.model import message_text
from continuum_runtime.errors import error_details

# Over transcript's inline limit (64 KiB): a page carries this user message as a stub.
LONG_TEXT = "Please rename name to displayName in every module. " * 2000


async def test_a_retry_after_a_restart_answers_the_first_turn_and_appends_nothing(
    tmp_path: Path, database_url: str
) -> None:
    async with running_agent(tmp_path, database_url) as first:
        await first.new_session("s1")
        started = await first.start_turn("s1", LONG_TEXT, client_request_id="req-1")
        await first.wait_idle("s1")
        # A later turn of its own: the retry looks past it.
        await first.start_turn("s1", "and then?", client_request_id="req-2")
        await first.wait_idle("s1")
        await first.service.stop(grace=0)

        async with replica(first, tmp_path / "restarted") as restarted:
            again = await restarted.start_turn("s1", LONG_TEXT, client_request_id="req-1")
            with pytest.raises(grpc.aio.AioRpcError) as reused:
                await restarted.start_turn("s1", "another text", client_request_id="req-1")
            messages = await restarted.messages("s1")

    assert again == started
    assert reused.value.code() == grpc.StatusCode.ABORTED
    assert error_details(reused.value).reason == "CLIENT_REQUEST_ID_REUSED"
    users = [m for m in messages if m.role == tpb.MESSAGE_ROLE_USER]
    assert [(m.message_id, m.metadata["clientRequestId"]) for m in users] == [
        (started.user_message_id, "req-1"),
        (users[1].message_id, "req-2"),
    ]
    assert message_text(users[0]) == LONG_TEXT
    # The replayed answer started no turn: the history ends with the second turn's answer.
    assert messages[-1].role == tpb.MESSAGE_ROLE_ASSISTANT and not messages[-1].tool_calls


async def test_a_retry_at_another_replica_while_the_turn_runs_answers_that_turn(
    tmp_path: Path, database_url: str
) -> None:
    # Written slowly (about 45 words at 0.2 s): the turn still runs while the second replica starts.
    async with running_agent(tmp_path, database_url, offline_delta_seconds=0.2) as first:
        await first.new_session("s1")
        started = await first.start_turn("s1", "hello there", client_request_id="req-1")
        async with replica(first, tmp_path / "second") as second:
            # The claim is held by the running turn; the second replica finds the request's message.
            again = await second.start_turn("s1", "hello there", client_request_id="req-1")
            with pytest.raises(grpc.aio.AioRpcError) as other:
                await second.start_turn("s1", "hello there", client_request_id="req-other")
        assert await first.stop_turn("s1")
        await first.wait_idle("s1")
        users = [m for m in await first.messages("s1") if m.role == tpb.MESSAGE_ROLE_USER]

    assert again == started
    # Another request while the turn runs is refused as before.
    assert error_details(other.value).reason == "SESSION_ALREADY_RUNNING"
    assert [m.message_id for m in users] == [started.user_message_id]


async def test_the_lookup_is_bounded_by_its_lookback(tmp_path: Path, database_url: str) -> None:
    async with running_agent(tmp_path, database_url) as first:
        await first.new_session("s1")
        started = await first.start_turn("s1", "first", client_request_id="req-1")
        await first.wait_idle("s1")
        for turn in range(2):
            await first.start_turn("s1", f"later {turn}")
            await first.wait_idle("s1")

        async with replica(first, tmp_path / "near", replay_lookback_user_messages=3) as near:
            assert await near.start_turn("s1", "first", client_request_id="req-1") == started
        # Looking back two USER messages only, the request is out of reach: a new turn starts.
        async with replica(first, tmp_path / "short", replay_lookback_user_messages=2) as short:
            beyond = await short.start_turn("s1", "first", client_request_id="req-1")
            await short.wait_idle("s1")

    assert beyond.user_message_id > started.user_message_id


async def test_a_long_history_costs_one_page_per_lookup(tmp_path: Path, database_url: str) -> None:
    async with running_agent(tmp_path, database_url) as first:
        await first.new_session("s1")
        transcript = first.services.transcript
        await append(transcript, "s1", user("an old request"))
        for batch in range(4):
            await append(transcript, "s1", *(assistant(f"step {batch}.{n} " + "x" * 2000) for n in range(1000)))
        proxy = RecordingProxy()
        proxy.target(transcript.service.port)
        await proxy.start()
        try:
            async with replica(first, tmp_path / "counted", transcript_address=f"127.0.0.1:{proxy.port}") as counted:
                started = await counted.start_turn("s1", "a new request", client_request_id="req-new")
                await counted.wait_idle("s1")
        finally:
            await proxy.stop()

    pages = [tapi.ListMessagePageRequest.FromString(raw) for name, raw in proxy.calls if name == "ListMessagePage"]
    # 4,001 messages, not one USER message among the newest 200: one page of 200 read, then a new turn.
    assert [(page.anchor_message_id, page.page_size) for page in pages] == [(0, 200)]
    assert not [name for name, _ in proxy.calls if name == "GetMessage"]
    assert started.user_message_id > 4001
