"""`follow_hub` against a scripted upstream: switch points, catch-up, fates shared and not shared."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, cast

import grpc
import pytest

from continuum.transcript.v1 import follow_pb2, resources_pb2, transcript_service_pb2
from continuum_gateway.follow_hub import Close, Hub, Hubs, Outbox, alignment_key, frame_message
from continuum_gateway.upstream import Upstreams

Frame = transcript_service_pb2.FollowResponse
GENERATION = 3


class _Call:
    """A scripted Follow call: frames (or an error) as the test pushes them."""

    def __init__(self) -> None:
        self.items: asyncio.Queue[Frame | BaseException | None] = asyncio.Queue()

    def __aiter__(self) -> _Call:
        return self

    async def __anext__(self) -> Frame:
        item = await self.items.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item


class _Upstreams:
    """Stands in for `Upstreams`: every Follow call is a `_Call` the test drives."""

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self.users: list[str] = []
        self.open_follows = 0

    @asynccontextmanager
    async def follow_transcript(
        self, request: transcript_service_pb2.FollowRequest, *, user: str
    ) -> AsyncIterator[Any]:
        call = _Call()
        self.calls.append(call)
        self.users.append(user)
        self.open_follows += 1
        try:
            yield call
        finally:
            self.open_follows -= 1


class _RpcError(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="scripted")


def handshake() -> Frame:
    return Frame(stream_generation=GENERATION, handshake=follow_pb2.HandshakeFrame(protocol="transcript-v2"))


def snapshot_end(seq: int) -> Frame:
    return Frame(stream_generation=GENERATION, snapshot_end=follow_pb2.SnapshotEndFrame(seq=seq))


def batch(seq: int) -> Frame:
    return Frame(stream_generation=GENERATION, batch=follow_pb2.BatchFrame(base_seq=seq - 1, seq=seq))


def chunk(index: int) -> Frame:
    ref = follow_pb2.AttemptRef(message_key="m", attempt=1)
    return Frame(stream_generation=GENERATION, chunk=transcript_service_pb2.ChunkFrame(attempt=ref, chunk_index=index))


def heartbeat(seq: int) -> Frame:
    return Frame(stream_generation=GENERATION, heartbeat=follow_pb2.HeartbeatFrame(commit_seq=seq, durable_seq=seq))


def resync(reason: int = follow_pb2.RESYNC_REASON_REWRITE) -> Frame:
    return Frame(stream_generation=GENERATION, resync=follow_pb2.ResyncFrame(reason=reason))  # type: ignore[arg-type]


REQUEST = transcript_service_pb2.FollowRequest(session_id="s1", capabilities=["transcript-v2"])


def drain(outbox: Outbox) -> list[dict[str, Any] | Close]:
    """Everything queued: parsed messages, then the close if queued."""
    items: list[dict[str, Any] | Close] = []
    while len(outbox):
        item = outbox._queue.get_nowait()
        items.append(item if isinstance(item, Close) else json.loads(item))
    outbox.queued_chars = 0
    return items


def describe(items: list[dict[str, Any] | Close]) -> list[str]:
    """Short names: "batch:5", "chunk:2", "close:1000", ..."""
    names = []
    for item in items:
        if isinstance(item, Close):
            names.append(f"close:{item.code}")
        elif item["type"] == "batch":
            names.append(f"batch:{item['batch']['seq']}")
        elif item["type"] == "chunk":
            names.append(f"chunk:{item['chunk']['chunkIndex']}")
        else:
            names.append(str(item["type"]))
    return names


async def settle() -> None:
    """Let the hub's task take every frame pushed so far."""
    for _ in range(5):
        await asyncio.sleep(0)


class Private:
    """A joining browser's own stream as `follow._Relay` runs it: relay each frame, then offer the
    hub its switch point once past its own snapshot."""

    def __init__(self, hub: Hub, outbox: Outbox) -> None:
        self.hub = hub
        self.outbox = outbox

    def relay(self, frame: Frame) -> bool:
        """True when the browser switched to the hub with this frame."""
        kind = frame.WhichOneof("frame")
        assert not self.outbox.attached.is_set()
        assert self.outbox.deliver(frame_message(frame, kind), frame.stream_generation, kind)
        if kind in ("handshake", "snapshot_end", "heartbeat"):
            return False
        return self.hub.align(self.outbox, alignment_key(frame, kind))

    def baseline(self, seq: int = 10) -> None:
        """Its own handshake and snapshot, cut at `seq`: no switch point yet."""
        assert not self.relay(handshake())
        assert not self.relay(snapshot_end(seq))


@pytest.fixture
async def hubs() -> AsyncIterator[Hubs]:
    registry = Hubs(recent_frames=8, recent_chars=1 << 20)
    try:
        yield registry
    finally:
        await registry.close()


async def _live_hub(hubs: Hubs, upstreams: _Upstreams, seq: int = 10) -> tuple[Hub, Outbox, _Call]:
    """A hub whose creator got its baseline and is live at `seq`."""
    creator = Outbox(64, 1 << 20)
    hub, created = hubs.join(cast(Upstreams, upstreams), REQUEST, "alice", creator)
    assert created
    await settle()
    (call,) = upstreams.calls
    for frame in (handshake(), snapshot_end(seq)):
        call.items.put_nowait(frame)
    await settle()
    assert describe(drain(creator)) == ["handshake", "snapshotEnd"]
    assert hub.live
    return hub, creator, call


async def test_a_browser_behind_the_hub_catches_up_from_its_recent_frames(hubs: Hubs) -> None:
    upstreams = _Upstreams()
    hub, creator, call = await _live_hub(hubs, upstreams)
    for frame in (chunk(0), batch(11), chunk(1), batch(12), chunk(2)):
        call.items.put_nowait(frame)
    await settle()
    joiner = Outbox(64, 1 << 20)
    again, created = hubs.join(cast(Upstreams, upstreams), REQUEST, "alice", joiner)
    assert (again, created) == (hub, False)
    private = Private(hub, joiner)
    # Its own baseline was cut after batch 10; its own stream is one switch point behind the hub.
    private.baseline()
    assert not private.relay(chunk(0))
    assert private.relay(batch(11))
    # What the hub relayed after batch 11, then live frames, exactly once each.
    call.items.put_nowait(batch(13))
    await settle()
    assert describe(drain(joiner)) == [
        "handshake",
        "snapshotEnd",
        "chunk:0",
        "batch:11",
        "chunk:1",
        "batch:12",
        "chunk:2",
        "batch:13",
    ]
    assert describe(drain(creator)) == ["chunk:0", "batch:11", "chunk:1", "batch:12", "chunk:2", "batch:13"]
    assert upstreams.open_follows == 1
    assert hub.subscribers == {creator, joiner}
    assert hub.switched == 1


async def test_a_browser_gone_cannot_join_the_hub(hubs: Hubs) -> None:
    upstreams = _Upstreams()
    hub, creator, _ = await _live_hub(hubs, upstreams)
    joiner = Outbox(64, 1 << 20)
    private = Private(hub, joiner)
    private.baseline()
    # The browser left while its reader still had a frame in hand.
    joiner.abandon()
    hub.leave(joiner)
    assert not hub.align(joiner, ("batch", GENERATION, 11))
    assert hub.waiting == 0
    hub.leave(creator)
    await settle()
    assert hub.over
    assert upstreams.open_follows == 0


async def test_a_browser_ahead_of_the_hub_switches_when_the_hub_gets_there(hubs: Hubs) -> None:
    upstreams = _Upstreams()
    hub, creator, call = await _live_hub(hubs, upstreams)
    joiner = Outbox(64, 1 << 20)
    hubs.join(cast(Upstreams, upstreams), REQUEST, "alice", joiner)
    private = Private(hub, joiner)
    private.baseline()
    assert not private.relay(chunk(0))
    assert not private.relay(batch(11))
    assert hub.waiting == 1
    # The hub reaches batch 11: the browser had it already; it takes the hub's frames after it.
    for frame in (chunk(0), batch(11), chunk(1)):
        call.items.put_nowait(frame)
    await settle()
    assert joiner.attached.is_set()
    assert hub.waiting == 0
    assert describe(drain(joiner)) == ["handshake", "snapshotEnd", "chunk:0", "batch:11", "chunk:1"]
    assert describe(drain(creator)) == ["chunk:0", "batch:11", "chunk:1"]


async def test_a_frame_that_is_no_switch_point_cancels_the_wait(hubs: Hubs) -> None:
    upstreams = _Upstreams()
    hub, _, call = await _live_hub(hubs, upstreams)
    joiner = Outbox(64, 1 << 20)
    hubs.join(cast(Upstreams, upstreams), REQUEST, "alice", joiner)
    private = Private(hub, joiner)
    private.baseline()
    private.relay(batch(11))
    # Its own stream moved on past batch 11 before the hub got there: switching at batch 11 now
    # would relay chunk 0 twice.
    private.relay(chunk(0))
    assert hub.waiting == 0
    for frame in (batch(11), chunk(0)):
        call.items.put_nowait(frame)
    await settle()
    assert not joiner.attached.is_set()
    # Heartbeats are each stream's own: they do not move the switch point.
    private.relay(batch(12))
    private.relay(heartbeat(12))
    call.items.put_nowait(batch(12))
    await settle()
    assert joiner.attached.is_set()
    assert describe(drain(joiner)) == ["handshake", "snapshotEnd", "batch:11", "chunk:0", "batch:12", "heartbeat"]


async def _joined_behind(hubs: Hubs, frame_of: Callable[[int], Frame]) -> tuple[Private, _Call]:
    """A browser joining once the hub relayed frames 11..29, its own stream at 11: still behind."""
    upstreams = _Upstreams()
    hub, _, call = await _live_hub(hubs, upstreams)
    for seq in range(11, 30):
        call.items.put_nowait(frame_of(seq))
    await settle()
    joiner = Outbox(64, 1 << 24)
    hubs.join(cast(Upstreams, upstreams), REQUEST, "alice", joiner)
    private = Private(hub, joiner)
    private.baseline()
    assert not private.relay(frame_of(11))
    return private, call


async def test_a_browser_too_far_behind_stays_on_its_own_stream(hubs: Hubs) -> None:
    # More than the 8 recent frames the hub keeps.
    private, call = await _joined_behind(hubs, batch)
    joiner = private.outbox
    assert not private.relay(batch(21))  # still forgotten: the hub keeps 22..29
    assert private.relay(batch(22))
    assert describe(drain(joiner))[-9:] == [f"batch:{seq}" for seq in (21, 22, *range(23, 30))]
    call.items.put_nowait(batch(30))
    await settle()
    assert describe(drain(joiner)) == ["batch:30"]


def large_batch(seq: int) -> Frame:
    """A batch carrying a message of 10,000 characters."""
    message = resources_pb2.Message(message_id=seq, content=[resources_pb2.ContentPart(text="x" * 10_000)])
    return Frame(
        stream_generation=GENERATION, batch=follow_pb2.BatchFrame(base_seq=seq - 1, seq=seq, messages=[message])
    )


async def test_the_recent_frames_are_bounded_in_characters_too() -> None:
    # Room for 100 frames, but only for three and a half of these large ones.
    size = len(frame_message(large_batch(11), "batch"))
    hubs = Hubs(recent_frames=100, recent_chars=size * 7 // 2)
    try:
        private, _ = await _joined_behind(hubs, large_batch)
        assert not private.relay(large_batch(26))  # forgotten: the hub keeps 27..29, by their size
        assert private.relay(large_batch(27))
        assert describe(drain(private.outbox))[-4:] == ["batch:26", "batch:27", "batch:28", "batch:29"]
    finally:
        await hubs.close()


async def test_one_browser_overflowing_or_leaving_leaves_the_others_alone(hubs: Hubs) -> None:
    upstreams = _Upstreams()
    creator = Outbox(4, 1 << 20)
    hub, _ = hubs.join(cast(Upstreams, upstreams), REQUEST, "alice", creator)
    await settle()
    (call,) = upstreams.calls
    for frame in (handshake(), snapshot_end(10), batch(11)):
        call.items.put_nowait(frame)
    await settle()
    joiner = Outbox(64, 1 << 20)
    private = Private(hub, joiner)
    private.baseline()
    assert private.relay(batch(11))
    # The creator does not read: its fifth queued frame overflows it, and only it (its backlog is
    # dropped for the overflow resync).
    for seq in range(12, 16):
        call.items.put_nowait(batch(seq))
    await settle()
    items = drain(creator)
    assert describe(items) == ["resync", "close:4429"]
    resync_message = items[-2]
    assert isinstance(resync_message, dict)
    assert resync_message["resync"] == {"reason": "RESYNC_REASON_OVERFLOW", "resumable": True}
    assert creator.outcome == "overflow"
    assert hub.subscribers == {joiner}
    hub.leave(creator)
    call.items.put_nowait(batch(16))
    await settle()
    assert describe(drain(joiner))[-5:] == ["batch:12", "batch:13", "batch:14", "batch:15", "batch:16"]
    assert upstreams.open_follows == 1
    # The last browser leaving ends the upstream call and the hub.
    hub.leave(joiner)
    await settle()
    assert upstreams.open_follows == 0
    assert hub.over
    assert len(hubs) == 0


async def test_a_joiner_waiting_keeps_the_hub_when_every_subscriber_left(hubs: Hubs) -> None:
    upstreams = _Upstreams()
    hub, creator, call = await _live_hub(hubs, upstreams)
    joiner = Outbox(64, 1 << 20)
    private = Private(hub, joiner)
    private.baseline()
    private.relay(batch(11))
    hub.leave(creator)
    await settle()
    assert upstreams.open_follows == 1
    call.items.put_nowait(batch(11))
    call.items.put_nowait(batch(12))
    await settle()
    assert describe(drain(joiner))[-2:] == ["batch:11", "batch:12"]
    hub.leave(joiner)
    await settle()
    assert upstreams.open_follows == 0


async def test_a_resync_reaches_every_browser_then_each_closes_normally(hubs: Hubs) -> None:
    upstreams = _Upstreams()
    hub, creator, call = await _live_hub(hubs, upstreams)
    joiner = Outbox(64, 1 << 20)
    private = Private(hub, joiner)
    private.baseline()
    # A browser still on its own stream is not the hub's to end: its own stream relays the resync.
    bystander = Outbox(64, 1 << 20)
    by_private = Private(hub, bystander)
    by_private.baseline(11)
    by_private.relay(batch(99))
    call.items.put_nowait(batch(11))
    await settle()
    assert private.relay(batch(11))
    call.items.put_nowait(resync())
    call.items.put_nowait(None)  # transcript ends the stream after a resync
    await settle()
    for outbox in (creator, joiner):
        assert describe(drain(outbox))[-2:] == ["resync", "close:1000"]
        assert outbox.outcome == "resync"
        assert outbox.ended.is_set()
    assert not bystander.closed
    assert hub.over
    assert len(hubs) == 0
    assert upstreams.open_follows == 0
    # The next browser starts a new hub, with a call of its own.
    _, created = hubs.join(cast(Upstreams, upstreams), REQUEST, "alice", Outbox(64, 1 << 20))
    assert created
    await settle()
    assert len(upstreams.calls) == 2


async def test_an_upstream_error_reaches_every_browser_on_the_hub(hubs: Hubs) -> None:
    upstreams = _Upstreams()
    hub, creator, call = await _live_hub(hubs, upstreams)
    joiner = Outbox(64, 1 << 20)
    private = Private(hub, joiner)
    private.baseline()
    call.items.put_nowait(batch(11))
    await settle()
    assert private.relay(batch(11))
    call.items.put_nowait(_RpcError(grpc.StatusCode.UNAVAILABLE))
    await settle()
    for outbox in (creator, joiner):
        items = drain(outbox)
        error, close = items[-2:]
        assert isinstance(error, dict)
        assert (error["type"], error["error"]["status"]) == ("error", "UNAVAILABLE")
        assert close == Close(4503)
        assert outbox.outcome == "upstream_unavailable"
    assert hub.over


async def test_hubs_are_per_user_session_and_capabilities(hubs: Hubs) -> None:
    upstreams = _Upstreams()
    alice, created = hubs.join(cast(Upstreams, upstreams), REQUEST, "alice", Outbox(8, 1 << 20))
    assert created
    bob, created = hubs.join(cast(Upstreams, upstreams), REQUEST, "bob", Outbox(8, 1 << 20))
    assert created and bob is not alice
    other = transcript_service_pb2.FollowRequest(session_id="s2", capabilities=["transcript-v2"])
    assert hubs.join(cast(Upstreams, upstreams), other, "alice", Outbox(8, 1 << 20))[1]
    more = transcript_service_pb2.FollowRequest(session_id="s1", capabilities=["transcript-v2", "x"])
    assert hubs.join(cast(Upstreams, upstreams), more, "alice", Outbox(8, 1 << 20))[1]
    same = transcript_service_pb2.FollowRequest(session_id="s1", capabilities=["transcript-v2", "transcript-v2"])
    assert hubs.join(cast(Upstreams, upstreams), same, "alice", Outbox(8, 1 << 20)) == (alice, False)
    await settle()
    # Each upstream call acts as the hub's user: transcript authorizes that user only.
    assert upstreams.users == ["alice", "bob", "alice", "alice"]
    await hubs.close()
    assert upstreams.open_follows == 0
