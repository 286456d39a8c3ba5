"""Shared Follow upstreams: one transcript Follow stream, and one JSON text per frame, for every browser
following the same session as the same user.

Why: a session watched by many browsers (a team on one run, a wall display, the fan-out benchmark)
used to cost one upstream stream per browser, and every frame was read from gRPC, converted to proto
JSON and serialized once per browser. A `Hub` reads the stream once and converts each frame once;
each browser only pays for queueing the shared text and writing it to its socket.

Who shares: hubs are keyed by (user, session, capabilities). Transcript authorizes every Follow call
for its acting user, so a hub only ever serves browsers of the user its own upstream call was
authorized for; a browser of another user gets a hub (and an authorization decision) of its own.
Browsers that resume (``resume`` in their hello) never share: their stream starts with a replay
that only their cursor determines, so they keep a private upstream, as before.

How a browser joins, so that it still gets its own baseline:

* The first browser of a key creates the hub, whose upstream call is that browser's Follow: it
  receives the hub's frames from the handshake on.
* A later browser opens its own, private Follow call (which is also transcript authorizing it) and is
  relayed its own handshake and snapshot from it. Once live (past its ``snapshotEnd``), each suffix
  frame it is relayed is checked against the hub: the frames after a snapshot are the session's one
  ordered broadcast, the same for every follower (only heartbeats, and a follower's own overflow
  resync, are per stream). When the browser's last relayed frame is a frame the hub has also relayed
  (the hub keeps its recent frames), the browser switches: it gets the hub's frames after that one
  (catching up from the hub's recent frames if its own stream was behind), and its private call is
  cancelled. If its own stream is ahead, the hub switches it over when it reaches the same frame.
* Only frames that occur once per stream generation mark a switch point: batches and watermarks (their
  ``seq``) and settlements (the seq of the message they settle). Chunks and attempt frames are only
  relayed, never matched: an attempt reference could in principle be reopened after its commit.

Per browser, nothing else changes: its own bounded outbox (the same overflow bounds and overflow
resync, which ends that browser only), its own socket and close code. A resync from transcript, the
end of the stream or an upstream error reaches every browser on the hub, as it would have reached
each on its own stream. The hub's upstream call is cancelled as soon as no browser uses it (the last
one left, fell behind, or none is waiting to switch over).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple

import grpc

from continuum.transcript.v1 import follow_pb2, transcript_service_pb2
from continuum_gateway.errors import (
    WEBSOCKET_CLOSE_CODE,
    UpstreamError,
    body_close_code,
    internal_error_body,
    upstream_error_body,
    websocket_error_message,
)
from continuum_gateway.protojson import to_json
from continuum_gateway.upstream import TRANSCRIPT, Upstreams

logger = logging.getLogger("continuum.gateway.follow")

# Key of the lifespan state entry holding the app's `Hubs`.
STATE_KEY = "follow_hubs"
NORMAL_CLOSURE = WEBSOCKET_CLOSE_CODE[grpc.StatusCode.OK]
# A browser too slow for its stream: RESOURCE_EXHAUSTED's close code (4429).
OVERFLOW_CLOSE_CODE = WEBSOCKET_CLOSE_CODE[grpc.StatusCode.RESOURCE_EXHAUSTED]

# Which browsers may share a stream: same user, same session, same capabilities.
HubKey = tuple[str, str, tuple[str, ...]]
# A suffix frame that occurs once per stream generation: (kind, stream_generation, seq).
AlignKey = tuple[str, int, int]


def _dumps(message: dict[str, Any]) -> str:
    return json.dumps(message, separators=(",", ":"), ensure_ascii=False)


def frame_message(frame: transcript_service_pb2.FollowResponse, kind: str | None = None) -> str:
    """One upstream frame as the browser's JSON text message (`kind`: its oneof field, if known)."""
    if kind is None:
        kind = frame.WhichOneof("frame")
    name = frame.DESCRIPTOR.fields_by_name[kind].json_name if kind is not None else "unknown"
    return _dumps({"type": name, **to_json(frame)})


def overflow_message(stream_generation: int) -> str:
    """The gateway's own resync, sent in place of the frames a slow browser could not take."""
    frame = transcript_service_pb2.FollowResponse(
        stream_generation=stream_generation,
        resync=follow_pb2.ResyncFrame(reason=follow_pb2.RESYNC_REASON_OVERFLOW, resumable=True),
    )
    return frame_message(frame)


def alignment_key(frame: transcript_service_pb2.FollowResponse, kind: str | None) -> AlignKey | None:
    """The frame's identity if it can mark a switch point (it occurs once per stream generation), else None."""
    if kind == "batch":
        return ("batch", frame.stream_generation, frame.batch.seq)
    if kind == "watermark":
        return ("watermark", frame.stream_generation, frame.watermark.seq)
    if kind == "settlement":
        return ("settlement", frame.stream_generation, frame.settlement.seq)
    return None


def hub_key(user: str, request: transcript_service_pb2.FollowRequest) -> HubKey:
    """The hub a (non-resuming) Follow request of `user` may share."""
    return (user, request.session_id, tuple(sorted(set(request.capabilities))))


@dataclass(frozen=True)
class Close:
    """The last item of an outbox: close the socket with this code."""

    code: int


class Outbox:
    """One browser's bounded queue of JSON messages, ending with a `Close`.

    Fed by the browser's private upstream call or by a hub, drained by the browser's sender. When a
    message would exceed `buffer_frames` messages or `buffer_chars` characters (a lone message always
    fits), what is queued is dropped for an overflow resync and the close code 4429.
    """

    def __init__(self, buffer_frames: int, buffer_chars: int) -> None:
        self._buffer_frames = buffer_frames
        self._buffer_chars = buffer_chars
        self._queue: asyncio.Queue[str | Close] = asyncio.Queue()
        # Characters of the messages in the queue (frames can be megabytes each).
        self.queued_chars = 0
        self.stream_generation = 0
        self.outcome = "browser_closed"
        # A Close is queued: nothing more goes in.
        self.closed = False
        self.ended = asyncio.Event()
        # A hub feeds this outbox (from now on, for a browser that switched over).
        self.attached = asyncio.Event()

    def __len__(self) -> int:
        """Messages (and the close) queued."""
        return self._queue.qsize()

    def deliver(self, text: str, stream_generation: int, kind: str | None) -> bool:
        """Queue one frame's message; False when the outbox is closed (or just overflowed)."""
        if self.closed:
            return False
        self.stream_generation = stream_generation
        if not self._queue.empty() and (
            self._queue.qsize() >= self._buffer_frames or self.queued_chars + len(text) > self._buffer_chars
        ):
            self.overflow()
            return False
        self.queued_chars += len(text)
        self._queue.put_nowait(text)
        if kind == "resync":
            self.outcome = "resync"
        return True

    def end(self) -> None:
        """The upstream stream ended (after a resync, normally): close normally after what is queued."""
        if self.closed:
            return
        if self.outcome != "resync":
            self.outcome = "upstream_ended"
        self._close(NORMAL_CLOSURE)

    def fail(self, body: dict[str, Any], outcome: str) -> None:
        """End with an error message and its close code, after what is queued."""
        if self.closed:
            return
        self.outcome = outcome
        self._queue.put_nowait(websocket_error_message(body))
        self._close(body_close_code(body))

    def overflow(self) -> None:
        """Drop what the browser could not take: the resync tells it to re-follow from what it applied."""
        if self.closed:
            return
        while not self._queue.empty():
            self._queue.get_nowait()
        self.queued_chars = 0
        self.outcome = "overflow"
        self._queue.put_nowait(overflow_message(self.stream_generation))
        self._close(OVERFLOW_CLOSE_CODE)

    def abandon(self) -> None:
        """The browser is gone: take nothing more (a reader not yet cancelled cannot join a hub)."""
        self.closed = True

    def _close(self, code: int) -> None:
        self._queue.put_nowait(Close(code))
        self.closed = True
        self.ended.set()

    async def next(self) -> str | Close:
        """The next message to send, or the close."""
        item = await self._queue.get()
        if isinstance(item, str):
            self.queued_chars = max(0, self.queued_chars - len(item))
        return item


class _Relayed(NamedTuple):
    """A frame the hub relayed, as every browser gets it."""

    text: str
    stream_generation: int
    kind: str | None


class Hub:
    """One shared upstream Follow call and the outboxes it feeds (see the module docstring)."""

    def __init__(
        self,
        hubs: Hubs,
        key: HubKey,
        upstreams: Upstreams,
        request: transcript_service_pb2.FollowRequest,
        recent_frames: int,
        recent_chars: int,
    ) -> None:
        self.key = key
        self._hubs = hubs
        self._upstreams = upstreams
        self._request = request
        self.subscribers: set[Outbox] = set()
        # Browsers on private streams, by the switch point their last relayed frame is.
        self._waiting: dict[AlignKey, set[Outbox]] = {}
        self._waiting_at: dict[Outbox, AlignKey] = {}
        # The most recent suffix frames, at most `recent_frames` of them and `recent_chars` characters
        # (the newest is kept even alone above that; `_first` is the stream position of the oldest),
        # and the position of each switch point among them.
        self._recent: deque[_Relayed] = deque()
        self._recent_limit = max(1, recent_frames)
        self._recent_char_limit = recent_chars
        self._recent_chars = 0
        self._first = 0
        self._positions: dict[AlignKey, int] = {}
        self._keys: deque[tuple[int, AlignKey]] = deque()
        # Past the hub's own snapshot: what follows is the session's shared suffix.
        self.live = False
        self.over = False
        # Browsers that switched over from their own stream.
        self.switched = 0
        self._task: asyncio.Task[None] | None = None

    @property
    def waiting(self) -> int:
        """Browsers on private streams waiting to switch over."""
        return len(self._waiting_at)

    def start(self, creator: Outbox) -> None:
        """Open the upstream call; `creator` gets every frame of it, from the handshake on."""
        self.subscribers.add(creator)
        creator.attached.set()
        self._task = asyncio.create_task(self._run(), name=f"follow-hub-{self.key[1]}")
        # Also when cancelled before it ever ran.
        self._task.add_done_callback(lambda _: self._hubs.ended(self))

    def align(self, outbox: Outbox, key: AlignKey | None) -> bool:
        """A browser on a private stream was just relayed a suffix frame of switch point `key` (None: a
        frame that is no switch point). Switch it over if the hub is there or further; else note
        where it is, so the hub switches it when it gets there. True when it switched now."""
        self._unwait(outbox)
        if self.over or outbox.closed or key is None:
            return False
        position = self._positions.get(key)
        if position is None:
            self._waiting.setdefault(key, set()).add(outbox)
            self._waiting_at[outbox] = key
            return False
        self._attach(outbox, position + 1)
        return True

    def leave(self, outbox: Outbox) -> None:
        """A browser is gone; the upstream call ends with the last one."""
        self.subscribers.discard(outbox)
        self._unwait(outbox)
        if not self.over and not self.subscribers and not self._waiting_at:
            self._retire()
            if self._task is not None:
                self._task.cancel()

    async def wait_closed(self) -> None:
        """Until the upstream call is over."""
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    def cancel(self) -> None:
        """End the upstream call now (the gateway is stopping)."""
        self._retire()
        if self._task is not None:
            self._task.cancel()

    def _unwait(self, outbox: Outbox) -> None:
        key = self._waiting_at.pop(outbox, None)
        if key is not None:
            waiting = self._waiting[key]
            waiting.discard(outbox)
            if not waiting:
                del self._waiting[key]

    def _attach(self, outbox: Outbox, position: int) -> None:
        """Feed `outbox` every frame from stream position `position` on."""
        self.switched += 1
        # Its reader stops at once (before its next frame) and its own call is cancelled.
        outbox.attached.set()
        for index in range(max(0, position - self._first), len(self._recent)):
            relayed = self._recent[index]
            if not outbox.deliver(relayed.text, relayed.stream_generation, relayed.kind):
                return
        self.subscribers.add(outbox)

    async def _run(self) -> None:
        try:
            async with self._upstreams.follow_transcript(self._request, user=self.key[0]) as call:
                async for frame in call:
                    if not self._relay(frame):
                        return  # nobody left to relay to
            self._finish(lambda outbox: outbox.end())
        except grpc.aio.AioRpcError as error:
            body = upstream_error_body(UpstreamError(TRANSCRIPT, error))
            outcome = f"upstream_{error.code().name.lower()}"
            self._finish(lambda outbox: outbox.fail(body, outcome))
        except Exception:
            # The formatter records the exception type only: messages could quote content.
            logger.exception("follow hub failed", extra={"session_id": self.key[1]})
            self._finish(lambda outbox: outbox.fail(internal_error_body(), "internal_error"))
        finally:
            self._retire()

    def _relay(self, frame: transcript_service_pb2.FollowResponse) -> bool:
        """Relay one upstream frame to every subscriber; False when nobody is left to relay to."""
        kind = frame.WhichOneof("frame")
        relayed = _Relayed(frame_message(frame, kind), frame.stream_generation, kind)
        dropped = [outbox for outbox in self.subscribers if not outbox.deliver(*relayed)]
        for outbox in dropped:
            self.subscribers.discard(outbox)
        if self.live:
            self._remember(frame, relayed)
        elif kind == "snapshot_end":
            self.live = True
        return bool(self.subscribers or self._waiting_at)

    def _remember(self, frame: transcript_service_pb2.FollowResponse, relayed: _Relayed) -> None:
        """Keep a suffix frame for browsers that switch over behind it; switch those waiting for it."""
        position = self._first + len(self._recent)
        self._recent.append(relayed)
        self._recent_chars += len(relayed.text)
        while len(self._recent) > 1 and (
            len(self._recent) > self._recent_limit or self._recent_chars > self._recent_char_limit
        ):
            self._recent_chars -= len(self._recent.popleft().text)
            self._first += 1
        while self._keys and self._keys[0][0] < self._first:
            _, old = self._keys.popleft()
            self._positions.pop(old, None)
        key = alignment_key(frame, relayed.kind)
        if key is None:
            return
        self._positions[key] = position
        self._keys.append((position, key))
        for outbox in self._waiting.pop(key, ()):
            del self._waiting_at[outbox]
            if not outbox.closed:
                self._attach(outbox, position + 1)

    def _finish(self, end: Any) -> None:
        """The upstream call is over: end every subscriber's stream the same way."""
        self._retire()
        for outbox in self.subscribers:
            end(outbox)
        self.subscribers.clear()

    def _retire(self) -> None:
        """Take no more browsers; those still on private streams stay there."""
        if self.over:
            return
        self.over = True
        self._hubs.forget(self)
        self._waiting.clear()
        self._waiting_at.clear()


class Hubs:
    """The app's hubs by key (held in the lifespan state)."""

    def __init__(self, recent_frames: int, recent_chars: int) -> None:
        self._recent_frames = recent_frames
        self._recent_chars = recent_chars
        self._hubs: dict[HubKey, Hub] = {}
        # Every hub whose call is not over yet (a retired hub may still be ending it).
        self._all: set[Hub] = set()

    def __len__(self) -> int:
        return len(self._hubs)

    def find(self, key: HubKey) -> Hub | None:
        """The running hub of `key`, if any."""
        hub = self._hubs.get(key)
        return hub if hub is not None and not hub.over else None

    def join(
        self, upstreams: Upstreams, request: transcript_service_pb2.FollowRequest, user: str, outbox: Outbox
    ) -> tuple[Hub, bool]:
        """The hub for `request`, and whether `outbox` created it (then the hub feeds it from the
        start; otherwise the browser follows privately until it can switch over)."""
        key = hub_key(user, request)
        hub = self.find(key)
        if hub is not None:
            return hub, False
        hub = Hub(self, key, upstreams, request, self._recent_frames, self._recent_chars)
        self._hubs[key] = hub
        self._all.add(hub)
        hub.start(outbox)
        return hub, True

    def forget(self, hub: Hub) -> None:
        """`hub` takes no more browsers."""
        if self._hubs.get(hub.key) is hub:
            del self._hubs[hub.key]

    def ended(self, hub: Hub) -> None:
        """`hub`'s upstream call is over."""
        self.forget(hub)
        self._all.discard(hub)

    async def close(self) -> None:
        """Cancel every upstream call still open (the app is stopping)."""
        hubs, self._all = self._all, set()
        for hub in hubs:
            hub.cancel()
        for hub in hubs:
            await hub.wait_closed()
