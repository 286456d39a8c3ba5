"""FollowClient against the real transcript server: baseline, suffix, attempts, rewrite, resume,
overflow, restart and old peers."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sqlite3
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import cast

import grpc
import pytest
from deadline_testing import eventually, within
from follow_testing import (
    FAST,
    Live,
    assistant,
    following,
    op_event,
    op_message,
    op_prompt,
    op_resolve,
    op_state,
    running,
    same_as_server,
    settings,
    sqlite_url,
    text,
    texts,
    tool,
    user,
)

from continuum.transcript.v1 import follow_pb2 as fpb
from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum.transcript.v1 import transcript_service_pb2_grpc as api_grpc
from continuum_follow import (
    Backoff,
    FollowClient,
    FollowError,
    Prefix,
    RecordStore,
    Renderer,
    Status,
    Update,
    UpgradeRequiredError,
)
from continuum_follow.client import MAX_SERVER_FAULTS
from continuum_transcript.server import start


async def test_a_session_is_followed_whole_through_its_life(tmp_path: Path, database_url: str) -> None:
    async with running(tmp_path, database_url) as live:
        session = await live.session()
        first, _ = await live.append(session, user("hello"), assistant("hi"))
        client = live.follower(session)
        async with following(client):
            await eventually(lambda: client.store.live and texts(client.store) == ["hello", "hi"], what="baseline")

            # Streaming, then the committed message with a tool call, then its result.
            await live.open(session, "m1")
            await live.chunks(session, "m1", 1, 0, "Let me ", "look")
            await eventually(
                lambda: client.store.prefixes.get("m1") == Prefix("m1", 1, 2, "Let me look"), what="chunks"
            )
            committed = await live.commit(session, "m1", 1, assistant("Let me look.", "call-1"))
            await live.append(session, tool("call-1", "file.txt"))
            await eventually(
                lambda: "call-1" in client.store.tools and client.store.tools["call-1"].result_message_id,
                what="the tool result",
            )
            assert "m1" not in client.store.prefixes
            await eventually(lambda: committed in client.store.settlements, what="settlement")
            assert client.store.settlements[committed] == fpb.SETTLEMENT_OUTCOME_COMMITTED
            assert client.store.tools["call-1"].call_message_id == committed

            # Runtime state, prompts and events, then a terminal batch.
            await live.publish(session, op_state(fpb.RUN_STATE_WAITING, "run-1"), op_prompt("approve-1"), op_event(3))
            await eventually(lambda: "approve-1" in client.store.prompts, what="the prompt")
            assert client.store.runtime_state.state == fpb.RUN_STATE_WAITING
            assert [event.compaction_marker.event_id for event in client.store.events] == [3]
            seq = await live.publish(session, op_resolve("approve-1"), op_state(fpb.RUN_STATE_IDLE), terminal=True)
            await eventually(
                lambda: client.store.cursor is not None and client.store.cursor.seq == seq, what="the terminal batch"
            )
            assert not client.store.prompts
            assert client.store.runtime_state.state == fpb.RUN_STATE_IDLE

            # A cancelled attempt keeps exactly what was shown, as an interrupted message.
            await live.open(session, "m2")
            await live.chunks(session, "m2", 1, 0, "par", "tial")
            interrupted = await live.cancel(session, "m2", 1)
            await eventually(
                lambda: interrupted in client.store.messages and "m2" not in client.store.prefixes,
                what="the interrupted message",
            )
            assert text(client.store.messages[interrupted]) == "partial"
            assert client.store.messages[interrupted].status == pb.MESSAGE_STATUS_INTERRUPTED

            # A retry replaces the attempt's text.
            await live.open(session, "m3")
            await live.chunks(session, "m3", 1, 0, "wrong")
            await live.open(session, "m3", 2)
            await live.chunks(session, "m3", 2, 0, "right")
            await eventually(lambda: client.store.prefixes.get("m3") == Prefix("m3", 2, 1, "right"), what="retry")

            server = await live.server_messages(session)
            assert same_as_server(client.store, server)
            assert len(client.store.messages) == len(server)
            assert set(client.store.prefixes) == {"m3"}
            assert (client.followed_times, sum(client.resyncs.values()), client.disconnects) == (1, 0, 0)

            # An edit rewrites the history: resync(REWRITE), then a baseline of the new stream generation.
            stream_generation = client.store.cursor.stream_generation if client.store.cursor else 0
            edit = api.EditUserMessageRequest(
                session_id=session, message_id=first, content=[pb.ContentPart(text="hey")]
            )
            await live.stub.EditUserMessage(edit, metadata=live.metadata)
            await eventually(lambda: client.resyncs["rewrite"] == 1 and client.store.live, what="re-follow")
            assert client.store.cursor is not None and client.store.cursor.stream_generation > stream_generation
            assert texts(client.store) == ["hey"]
            assert same_as_server(client.store, await live.server_messages(session))
            # The rewrite ended the open attempt on the server; the fresh baseline has no prefixes.
            assert client.store.prefixes == {}
            assert client.modes == {"baseline": 2}


async def test_a_disconnect_resumes_with_the_suffix_only(tmp_path: Path) -> None:
    async with running(tmp_path) as live:
        session = await live.session()
        await live.append(session, user("one"))
        # Slow enough that what is published right after the disconnect is missed.
        client = live.follower(session, backoff=Backoff(initial_seconds=0.5, jitter=0.0))
        async with following(client):
            await eventually(lambda: client.store.live and texts(client.store) == ["one"], what="baseline")
            await live.open(session, "m1")
            await live.chunks(session, "m1", 1, 0, "a")
            await eventually(lambda: "m1" in client.store.prefixes, what="the open attempt")

            client.disconnect()
            await eventually(lambda: client.disconnects == 1, what="disconnect")
            await live.append(session, user("two"))
            await live.chunks(session, "m1", 1, 1, "b", "c")
            await eventually(lambda: client.store.live and texts(client.store) == ["one", "two"], what="resume")

            assert client.store.prefixes["m1"] == Prefix("m1", 1, 3, "abc")
            assert client.modes == {"baseline": 1, "resume": 1}
            assert client.followed_times == 2
            assert not client.resyncs
            await live.chunks(session, "m1", 1, 3, "d")
            await eventually(lambda: client.store.prefixes["m1"].text == "abcd", what="the chunk after the resume")
            assert same_as_server(client.store, await live.server_messages(session))


async def test_a_stalled_follower_overflows_and_recovers_with_a_fresh_baseline(tmp_path: Path) -> None:
    # Without BDP probing the client's receive window stays small, so a stalled reader soon
    # stalls the server's writer and its bounded queue overflows.
    options = [("grpc.http2.bdp_probe", 0), ("grpc.max_receive_message_length", 64 * 1024 * 1024)]
    async with running(tmp_path, channel_options=options, follow_queue_bound=16, follow_replay_frames=16) as live:
        session = await live.session()
        await live.append(session, user("start"))
        client = live.follower(session)
        stalled = asyncio.Event()
        release = asyncio.Event()
        seen: list[Update] = []

        async def consume() -> None:
            async for update in client.updates():
                seen.append(update)
                if update.kind == "snapshot_end" and not stalled.is_set():
                    stalled.set()
                    await release.wait()

        task = asyncio.create_task(consume())
        try:
            await within(stalled.wait(), 10, "the follower's first baseline")
            big = "x" * 16 * 1024
            for index in range(120):
                await live.publish(session, op_message(user(f"{index} {big}")))
            release.set()
            await eventually(lambda: client.resyncs["overflow"] == 1 and client.store.live, what="overflow resync")
            await eventually(
                lambda: text(client.store.ordered_messages()[-1]).startswith("119 "), what="the last published message"
            )
        finally:
            client.stop()
            await within(task, 10, "the Follow client to stop")

        resync = [u for u in seen if u.outcome.status is Status.RESYNC]
        assert [u.outcome.reason for u in resync] == ["overflow"]
        # The cursor fell out of the replay window: the re-follow got a fresh baseline.
        assert client.modes == {"baseline": 2}
        assert same_as_server(client.store, await live.server_messages(session))


async def test_a_restarted_server_is_followed_again_not_taken_as_the_end(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path)
    service = await start(settings(tmp_path, url))
    port = service.port
    # One channel across both servers (the client's stub outlives the first one), reconnecting quickly.
    options = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 300)]
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options)
    live = Live(service, api_grpc.TranscriptServiceStub(channel))
    try:
        session = await live.session()
        await live.append(session, user("before"))
        client = live.follower(session)
        async with following(client):
            await eventually(lambda: client.store.live and texts(client.store) == ["before"], what="baseline")
            stream_generation = client.store.cursor.stream_generation if client.store.cursor else 0
            await service.stop(grace=0)
            # The server ends the stream with resync(SHUTDOWN), unless stopping cut the stream first.
            await eventually(lambda: client.resyncs["shutdown"] + client.disconnects >= 1, what="end of stream")
            # Down: calls fail and the client keeps trying, backing off.
            await eventually(lambda: client.followed_times >= 4, what="retries while down")
            service = live.service = await start(settings(tmp_path, url, port=port))
            # A new publisher binds with a new stream generation: the client is back on a fresh baseline.
            await eventually(
                lambda: (
                    client.store.live
                    and client.store.cursor
                    and client.store.cursor.stream_generation > stream_generation
                ),
                what="following again",
            )
            await live.append(session, user("after"))
            await eventually(lambda: texts(client.store) == ["before", "after"], what="news after the restart")
            assert client.modes == {"baseline": 2}
    finally:
        await channel.close()
        await service.stop(grace=0)


async def test_an_old_client_gets_a_clear_upgrade_error_and_no_retry_loop(tmp_path: Path) -> None:
    async with running(tmp_path) as live:
        session = await live.session()
        client = FollowClient(live.stub, session, live.metadata, capabilities=["transcript-v1"], backoff=FAST)

        with pytest.raises(UpgradeRequiredError, match="requires transcript-v2 but this client offers transcript-v1"):
            await within(client.run(), 10, "the old client to give up instead of retrying")

        assert client.followed_times == 1


async def test_following_a_missing_session_fails_without_retrying(tmp_path: Path) -> None:
    async with running(tmp_path) as live:
        client = live.follower("no-such-session")

        with pytest.raises(FollowError) as caught:
            await within(client.run(), 10, "the client to give up on a missing session instead of retrying")

        assert caught.value.details is not None and caught.value.details.reason == "SESSION_NOT_FOUND"
        assert client.followed_times == 1


async def test_a_frame_over_the_clients_message_limit_is_a_permanent_error_not_a_retry_loop(tmp_path: Path) -> None:
    # A client whose channel takes at most 4 KiB per message: the server's snapshot is larger.
    async with running(tmp_path, channel_options=[("grpc.max_receive_message_length", 4096)]) as live:
        session = await live.session()
        await live.append(session, user("y" * 20_000))
        client = live.follower(session)

        with pytest.raises(FollowError, match="larger than this client's message limit"):
            await asyncio.wait_for(client.run(), 10)

        assert client.followed_times == 1


async def test_a_server_failing_every_time_is_given_up_on_after_a_few_tries(tmp_path: Path) -> None:
    database = tmp_path / "t.db"
    async with running(tmp_path) as live:
        session = await live.session()
        # The database is broken under the server: every Follow fails inside it (INTERNAL).
        with sqlite3.connect(database) as broken:
            broken.execute("ALTER TABLE messages RENAME TO messages_gone")
        client = live.follower(session)

        with pytest.raises(FollowError, match="failed 5 times in a row"):
            await asyncio.wait_for(client.run(), 20)

        assert client.followed_times == MAX_SERVER_FAULTS


async def test_a_stub_in_the_store_loads_whole_by_id(tmp_path: Path) -> None:
    async with running(tmp_path) as live:
        session = await live.session()
        body = "big " * 100_000
        (big,) = await live.append(session, user(body))
        client = live.follower(session)
        async with following(client):
            await eventually(lambda: big in client.store.messages, what="the snapshot")
            stub = client.store.messages[big]
            assert stub.body_deferred and stub.preview.startswith("big big") and not stub.content

            loaded = await client.load_message(big)

        assert text(loaded) == body and not loaded.body_deferred and loaded.message_id == big


async def test_a_store_keeps_only_its_newest_messages_and_pages_on_from_there(tmp_path: Path) -> None:
    async with running(tmp_path) as live:
        session = await live.session()
        ids = await live.append(session, *[user(f"m{n}") for n in range(10)])
        client = live.follower(session, store=RecordStore(message_limit=4))
        async with following(client):
            await eventually(lambda: client.store.live, what="the baseline")
            more = await live.append(session, *[user(f"n{n}") for n in range(6)])
            await eventually(lambda: more[-1] in client.store.messages, what="the live messages")
        store = client.store
        assert sorted(store.messages) == more[-4:]
        assert store.has_older and store.history is not None
        assert store.history.before_message_id == more[-4]
        # The history cursor continues exactly before the oldest message kept.
        page = await live.stub.ListMessagePage(
            api.ListMessagePageRequest(
                session_id=session,
                anchor_message_id=store.history.before_message_id,
                page_size=100,
                stream_generation=store.history.stream_generation,
                snapshot_sequence=store.history.snapshot_sequence,
            ),
            metadata=live.metadata,
        )
        assert [m.message_id for m in page.messages] == ids + more[:-4]


async def test_a_server_that_cannot_be_reached_is_named_as_such_with_grpcs_reason() -> None:
    with socket.socket() as probe:  # a port the OS just handed out and took back: nothing listens
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    channel = grpc.aio.insecure_channel(address)
    try:
        client = FollowClient(api_grpc.TranscriptServiceStub(channel), "s", backoff=FAST)
        # An async generator, which the client's signature states as the iterator it is used as.
        async with contextlib.aclosing(cast(AsyncGenerator[Update, None], client.updates())) as updates:
            first = await within(anext(updates), 10, "the first failed call")
    finally:
        await channel.close()
    assert first.kind == "disconnect" and first.cause.startswith("UNAVAILABLE: ")
    shown = Renderer().render(first)
    assert shown.startswith("· cannot reach the transcript service (UNAVAILABLE: ") and "following again" in shown
