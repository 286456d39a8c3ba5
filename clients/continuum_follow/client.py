"""The Follow consumer: one long-lived loop of Follow calls feeding a `RecordStore`.

A stream ends in a resync (follow again: with the cursor when the resync is resumable, else for a
fresh baseline) or in a disconnect (follow again with the cursor). Neither means the session's
work is done, and the client never calls anything but Follow: following can't cause a model
request. Re-follows back off exponentially with jitter, so a failing server is not hammered.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from continuum.transcript.v1 import follow_pb2 as fpb
from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum.transcript.v1 import transcript_service_pb2_grpc as api_grpc
from continuum_follow.store import PROTOCOL, Outcome, RecordStore, Status
from continuum_runtime.errors import ErrorDetails, error_details

DISCONNECT = "disconnect"
UPGRADE_REQUIRED = "UPGRADE_REQUIRED"
# Failures that a later attempt may not meet: the server restarting, moving or briefly overloaded.
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
    }
)
# Failures that are retried only a few times in a row: a server fault may be passing, or may not.
RETRYABLE_FEW_TIMES = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})
# How many of those in a row end following with a FollowError.
MAX_SERVER_FAULTS = 5


class FollowError(Exception):
    """Following cannot go on, and trying again would not help (no such session, bad token, ...)."""

    def __init__(self, message: str, details: ErrorDetails | None = None) -> None:
        super().__init__(message)
        self.details = details


class UpgradeRequiredError(FollowError):
    """Client and server do not share the Follow protocol; one of them must be upgraded."""


@dataclass(frozen=True)
class Backoff:
    """Delays between Follow calls: exponential in consecutive failures, capped, jittered downwards."""

    initial_seconds: float = 0.25
    max_seconds: float = 15.0
    multiplier: float = 2.0
    # The share of each delay drawn at random, so many followers of a restarted server spread out.
    jitter: float = 0.5

    def delay(self, failures: int, rng: random.Random) -> float:
        """Seconds to wait before the next call after `failures` consecutive unhealthy streams."""
        base = min(self.max_seconds, self.initial_seconds * self.multiplier**failures)
        return base * (1.0 - self.jitter * rng.random())


@dataclass(frozen=True)
class Update:
    """One step of following: a frame and what applying it did, or a disconnect (frame None)."""

    frame: api.FollowResponse | None
    outcome: Outcome
    store: RecordStore
    # For a disconnect, what ended the call as gRPC said it ("UNAVAILABLE: ..."); "" when it just closed.
    cause: str = ""

    @property
    def kind(self) -> str:
        """The frame's kind ("batch", "chunk", ...), or "disconnect"."""
        if self.frame is None:
            return DISCONNECT
        return self.frame.WhichOneof("frame") or "unknown"


class FollowClient:
    """Follows one session for as long as it runs, keeping `store` whole."""

    def __init__(
        self,
        stub: api_grpc.TranscriptServiceStub,
        session_id: str,
        metadata: Sequence[tuple[str, str]] = (),
        *,
        capabilities: Sequence[str] = (PROTOCOL,),
        store: RecordStore | None = None,
        backoff: Backoff | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.store = store if store is not None else RecordStore()
        self.session_id = session_id
        self._stub = stub
        self._metadata = tuple(metadata)
        self._capabilities = list(capabilities)
        self._backoff = backoff if backoff is not None else Backoff()
        self._rng = rng if rng is not None else random.Random()
        self._call: Any = None
        self._wake = asyncio.Event()
        self._stopped = False
        self._dropping = False
        self._running = False
        self._server_faults = 0
        # What ended the last call, when it failed (see `Update.cause`).
        self._failure = ""
        # Counters, for diagnostics and tests.
        self.followed_times = 0
        self.frames_applied = 0
        self.disconnects = 0
        self.resyncs: Counter[str] = Counter()
        self.modes: Counter[str] = Counter()

    def stop(self) -> None:
        """End following; `run()` returns and `updates()` finishes. Safe from a signal handler."""
        self._stopped = True
        self._wake.set()
        if self._call is not None:
            self._call.cancel()

    async def load_message(self, message_id: int) -> pb.Message:
        """The whole body of a message of this session, e.g. one the store holds as a stub."""
        return await load_message(self._stub, self.session_id, message_id, self._metadata)

    def disconnect(self) -> None:
        """Drop the current stream as a network failure would; the client resumes with its cursor."""
        if self._call is not None:
            self._dropping = True
            self._call.cancel()

    async def run(self) -> None:
        """Follow until `stop()`. Raises `FollowError` when following cannot go on."""
        async for _ in self.updates():
            pass

    async def updates(self) -> AsyncIterator[Update]:
        """Follow until `stop()`, yielding every applied frame, resync and disconnect.

        Frames are read only as fast as the caller consumes updates: a caller that stalls makes
        the server's bounded queue overflow, which ends in a resync, never in lost frames.
        """
        if self._running:
            raise RuntimeError("a FollowClient runs one loop at a time")
        self._running = True
        try:
            resume = True
            failures = 0
            while not self._stopped:
                if self.followed_times:
                    await self._pause(self._backoff.delay(failures, self._rng))
                    if self._stopped:
                        return
                    failures += 1
                ended: Outcome | None = None
                async with contextlib.aclosing(self._follow_once(resume)) as stream:
                    async for update in stream:
                        if update.outcome.status is Status.RESYNC:
                            ended = update.outcome
                        elif self.store.live:
                            # The stream reached the live suffix: it was healthy, so re-follow quickly.
                            failures = 0
                        yield update
                if self._stopped:
                    return
                if ended is None:
                    self.disconnects += 1
                    ended = Outcome.resync(DISCONNECT, resumable=True)
                    yield Update(None, ended, self.store, self._failure)
                else:
                    self.resyncs[ended.reason] += 1
                resume = ended.resumable
        finally:
            self._running = False

    async def _follow_once(self, resume: bool) -> AsyncGenerator[Update, None]:
        """One Follow call, until its resync or its end."""
        request = api.FollowRequest(session_id=self.session_id, capabilities=self._capabilities)
        cursor = self.store.cursor
        if resume and cursor is not None:
            request.resume.CopyFrom(fpb.FollowCursor(stream_generation=cursor.stream_generation, seq=cursor.seq))
        call = self._stub.Follow(request, metadata=self._metadata)
        self._call = call
        self._dropping = False
        self._failure = ""
        self.followed_times += 1
        try:
            while True:
                frame = await call.read()
                if frame is grpc.aio.EOF:
                    return  # closed without a resync: a disconnect
                outcome = self.store.apply(frame)
                if outcome.status is Status.APPLIED:
                    self.frames_applied += 1
                    self._server_faults = 0
                if frame.WhichOneof("frame") == "handshake" and outcome.status is Status.APPLIED:
                    self.modes[fpb.FollowMode.Name(frame.handshake.mode).removeprefix("FOLLOW_MODE_").lower()] += 1
                yield Update(frame, outcome, self.store)
                if outcome.status is Status.RESYNC:
                    return
        except grpc.aio.AioRpcError as error:
            if not self._cancelled_by_us():
                _raise_if_permanent(error, self._capabilities)
                self._failure = f"{error.code().name}: {error.details()}"
                if error.code() in RETRYABLE_FEW_TIMES:
                    self._server_faults += 1
                    if self._server_faults >= MAX_SERVER_FAULTS:
                        details = error_details(error)
                        raise FollowError(
                            f"Follow failed {self._server_faults} times in a row on the server's side "
                            f"({details.code.name}); giving up",
                            details,
                        ) from error
        except asyncio.CancelledError:
            # grpc reports a call we cancelled (stop, disconnect) as CancelledError; only a
            # cancellation of our own task must propagate.
            task = asyncio.current_task()
            if (task is not None and task.cancelling()) or not self._cancelled_by_us():
                raise
        finally:
            self._call = None
            call.cancel()
            self.store.end_stream()

    def _cancelled_by_us(self) -> bool:
        return self._stopped or self._dropping

    async def _pause(self, seconds: float) -> None:
        # Wakes early on stop().
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)


async def load_message(
    stub: api_grpc.TranscriptServiceStub, session_id: str, message_id: int, metadata: Sequence[tuple[str, str]] = ()
) -> pb.Message:
    """The whole message a stub (`body_deferred`) stands for, assembled from StreamMessage's pieces."""
    header: pb.Message | None = None
    texts: dict[tuple[str, int], list[str]] = {}
    request = api.StreamMessageRequest(session_id=session_id, message_id=message_id)
    async for frame in stub.StreamMessage(request, metadata=metadata):
        if frame.WhichOneof("frame") == "header":
            header = frame.header
            continue
        target = frame.chunk.WhichOneof("target")
        if target is not None:
            texts.setdefault((target, getattr(frame.chunk, target)), []).append(frame.chunk.text)
    if header is None:
        raise FollowError(f"message {message_id} came without its header")
    for (target, index), parts in texts.items():
        if target == "content_index":
            header.content[index].text = "".join(parts)
        else:
            header.tool_calls[index].arguments = "".join(parts)
    return header


def _raise_if_permanent(error: grpc.aio.AioRpcError, capabilities: Sequence[str]) -> None:
    details = error_details(error)
    if details.code == grpc.StatusCode.FAILED_PRECONDITION and details.reason == UPGRADE_REQUIRED:
        required = details.metadata.get("required", "a newer protocol")
        offered = ", ".join(capabilities) or "nothing"
        raise UpgradeRequiredError(
            f"the transcript server requires {required} but this client offers {offered}: upgrade this client",
            details,
        ) from error
    if details.code == grpc.StatusCode.UNIMPLEMENTED:
        raise UpgradeRequiredError(
            f"the transcript server does not offer Follow ({PROTOCOL}): upgrade the server", details
        ) from error
    if details.code == grpc.StatusCode.RESOURCE_EXHAUSTED and not details.reason:
        # gRPC's own RESOURCE_EXHAUSTED: a frame larger than this client accepts. Retrying returns it again.
        raise FollowError(
            "a Follow frame was larger than this client's message limit; raise the channel's "
            f"max_receive_message_length or upgrade the server ({details.message})",
            details,
        ) from error
    if details.code not in RETRYABLE | RETRYABLE_FEW_TIMES and not (
        details.code == grpc.StatusCode.RESOURCE_EXHAUSTED and details.reason
    ):
        reason = f" {details.reason}" if details.reason else ""
        raise FollowError(f"Follow refused: {details.code.name}{reason}: {details.message}", details) from error
