"""The live publisher of one session: business sequence, sampling attempts, fan-out, durability.

Accepted batches get the next `commit_seq` and their message ids at once and are shown to
followers immediately; a flusher persists them behind, in order, and `durable_seq` catches up.
Frames leave through one ordered outbox: a terminal batch (and each settlement) waits there for
its persistence barrier, and everything after it waits behind it, so followers never see a gap.

All state changes and fan-out happen in synchronous code (no `await`), which on one event loop
is the publisher's lock; database I/O and transport writes happen outside it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from google.protobuf import json_format

from continuum.transcript.v1 import follow_pb2 as fpb
from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum_runtime.clock import Clock
from continuum_runtime.database import Database
from continuum_transcript import bodies, convert, persistence
from continuum_transcript.errors import (
    AttemptConflict,
    AttemptTooLarge,
    PublishBacklogFull,
    PublisherUnavailable,
    TooManyOpenAttempts,
    TooManyPendingPrompts,
)
from continuum_transcript.settings import TranscriptSettings
from continuum_transcript.validation import MessageRow, message_row

logger = logging.getLogger("continuum.transcript.publisher")

# What a frame costs in queues and the replay window beyond the message bodies it carries.
FRAME_OVERHEAD_BYTES = 64
# The most text one prefix frame of a snapshot or resume carries (whole chunks; a chunk is smaller).
PREFIX_PIECE_BYTES = 256 * 1024


@dataclass(frozen=True)
class PublisherLimits:
    """Every bound of one publisher: nothing it holds grows with the session's history."""

    queue_frames: int
    queue_bytes: int
    replay_frames: int
    replay_bytes: int
    id_block: int
    bodies: bodies.Limits
    max_open_attempts: int
    max_attempt_bytes: int
    max_pending_prompts: int
    backlog_bytes: int
    # An open attempt without a chunk for this long is taken for abandoned (its runtime died).
    abandoned_attempt_ms: int

    @classmethod
    def of(cls, settings: TranscriptSettings) -> PublisherLimits:
        """The limits the service's settings name."""
        return cls(
            queue_frames=settings.follow_queue_bound,
            queue_bytes=settings.follow_queue_bytes,
            replay_frames=settings.follow_replay_frames,
            replay_bytes=settings.follow_replay_bytes,
            id_block=settings.publisher_id_block,
            bodies=settings.limits(),
            max_open_attempts=settings.max_open_attempts,
            max_attempt_bytes=settings.max_message_bytes,
            max_pending_prompts=settings.max_pending_prompts,
            backlog_bytes=settings.publish_backlog_bytes,
            abandoned_attempt_ms=round(settings.publisher_idle_seconds * 1000),
        )


@dataclass
class Attempt:
    """An open sampling attempt and the chunks shown so far."""

    ref: fpb.AttemptRef
    chunks: list[str] = field(default_factory=list)
    text_bytes: int = 0
    # When it was opened or last showed a chunk (epoch ms).
    active_ms: int = 0


def prefix_pieces(ref: fpb.AttemptRef, chunks: Sequence[str], max_bytes: int) -> Iterator[fpb.ActivePrefix]:
    """The displayed text of an attempt as prefix frames of whole chunks, each within `max_bytes`
    (a single larger chunk is a piece of its own); at least one, even for an attempt without chunks."""
    first, size = 0, 0
    texts: list[str] = []
    for index, chunk in enumerate(chunks):
        length = bodies.utf8_size(chunk)
        if texts and size + length > max_bytes:
            yield fpb.ActivePrefix(attempt=ref, first_chunk_index=first, next_chunk_index=index, text="".join(texts))
            first, texts, size = index, [], 0
        texts.append(chunk)
        size += length
    yield fpb.ActivePrefix(attempt=ref, first_chunk_index=first, next_chunk_index=len(chunks), text="".join(texts))


@dataclass
class DeliveredView:
    """What followers have been shown so far: the state a new follower's snapshot starts from."""

    seq: int
    runtime_state: fpb.RuntimeState
    prompts: dict[str, fpb.PendingPrompt]
    prefixes: dict[str, Attempt] = field(default_factory=dict)
    event_no: int = 0

    def apply(self, frame: api.FollowResponse) -> None:
        """Advance the view by one delivered frame."""
        kind = frame.WhichOneof("frame")
        if kind == "batch":
            batch = frame.batch
            self.seq = batch.seq
            if batch.HasField("runtime_state"):
                self.runtime_state = batch.runtime_state
            for prompt in batch.prompts_upserted:
                self.prompts[prompt.prompt_id] = prompt
            for resolved in batch.prompts_resolved:
                self.prompts.pop(resolved, None)
            if batch.HasField("settles"):
                current = self.prefixes.get(batch.settles.message_key)
                if current is not None and current.ref.attempt == batch.settles.attempt:
                    del self.prefixes[batch.settles.message_key]
        elif kind == "watermark":
            self.seq = frame.watermark.seq
        elif kind == "attempt_opened":
            self.prefixes[frame.attempt_opened.message_key] = Attempt(frame.attempt_opened)
        elif kind == "chunk":
            current = self.prefixes.get(frame.chunk.attempt.message_key)
            if current is not None and current.ref.attempt == frame.chunk.attempt.attempt:
                current.chunks.append(frame.chunk.text)


class Subscription:
    """One follower's bounded queue (in frames and in bytes). Falling behind either bound ends it
    with resync(OVERFLOW)."""

    def __init__(self, bound: int, max_bytes: int) -> None:
        self._bound = bound
        self._max_bytes = max_bytes
        self._bytes = 0
        self._queue: asyncio.Queue[tuple[int, api.FollowResponse, int]] = asyncio.Queue()
        self.ended = False

    def offer(self, event_no: int, frame: api.FollowResponse, cost: int = FRAME_OVERHEAD_BYTES) -> None:
        """Queue a frame (`cost` bytes), or replace the backlog by a resync once a bound is exceeded."""
        if self.ended:
            return
        if self._queue.qsize() >= self._bound or self._bytes + cost > self._max_bytes:
            self.end(fpb.RESYNC_REASON_OVERFLOW, frame.stream_generation, resumable=True)
            return
        self._bytes += cost
        self._queue.put_nowait((event_no, frame, cost))

    def end(self, reason: int, stream_generation: int, *, resumable: bool) -> None:
        """Drop the backlog and leave only a resync frame."""
        if self.ended:
            return
        self.ended = True
        while not self._queue.empty():
            self._queue.get_nowait()
        self._bytes = 0
        resync = fpb.ResyncFrame(reason=reason, resumable=resumable)  # type: ignore[arg-type]
        frame = api.FollowResponse(stream_generation=stream_generation, resync=resync)
        self._queue.put_nowait((0, frame, FRAME_OVERHEAD_BYTES))

    async def next(self, seconds: float) -> tuple[int, api.FollowResponse] | None:
        """The next frame, or None after `seconds` of quiet (time for a heartbeat)."""
        if not self._queue.empty():
            # The common case under load: no timer task per frame.
            event_no, frame, cost = self._queue.get_nowait()
        else:
            try:
                event_no, frame, cost = await asyncio.wait_for(self._queue.get(), seconds)
            except TimeoutError:
                return None
        self._bytes -= cost
        return event_no, frame


@dataclass(frozen=True)
class Cut:
    """What a new follower starts from, captured atomically with its registration. Prefixes are
    the attempts' chunk lists as shown (references, not copies of their text)."""

    stream_generation: int
    seq: int
    event_no: int
    runtime_state: fpb.RuntimeState
    prompts: list[fpb.PendingPrompt]
    prefixes: list[tuple[fpb.AttemptRef, tuple[str, ...]]]
    replay: list[api.FollowResponse]
    replay_first_seq: int

    def prefix_frames(self) -> Iterator[fpb.ActivePrefix]:
        """The active prefixes in pieces of bounded size."""
        for ref, chunks in self.prefixes:
            yield from prefix_pieces(ref, chunks, PREFIX_PIECE_BYTES)


@dataclass
class _Outgoing:
    event_no: int
    barrier: int
    skeleton: api.FollowResponse
    # A batch's message rows (whole, or light stubs), converted into the frame only once somebody
    # needs it: with nobody following, appends never pay for building frames. A stub holds no body,
    # so neither the outbox nor the replay window keeps a large body alive.
    rows: list[dict[str, Any]] | None = None
    media_types: dict[str, str] | None = None
    # Bytes the frame stands for in queues and the replay window.
    cost: int = FRAME_OVERHEAD_BYTES

    @property
    def frame(self) -> api.FollowResponse:
        """The complete frame."""
        if self.rows is not None:
            self.skeleton.batch.messages.extend(convert.message(row, self.media_types) for row in self.rows)
            self.rows = None
        return self.skeleton


class SessionPublisher:
    """Owns one session's live transcript inside this process."""

    def __init__(
        self,
        session_id: str,
        owner: str,
        binding: persistence.Binding,
        database: Database,
        limits: PublisherLimits,
        *,
        on_closed: Callable[[SessionPublisher], None],
        clock: Clock,
    ) -> None:
        self.session_id = session_id
        self.owner = owner
        self.stream_generation = binding.stream_generation
        self.commit_seq = binding.durable_seq
        self.durable_seq = binding.durable_seq
        self._db = database
        self._limits = limits
        self._clock = clock
        self._on_closed = on_closed
        state = fpb.RuntimeState()
        json_format.ParseDict(binding.runtime_state, state, ignore_unknown_fields=True)
        prompts = {}
        for prompt_id, body in binding.pending_prompts.items():
            prompt = fpb.PendingPrompt()
            json_format.ParseDict(body, prompt, ignore_unknown_fields=True)
            prompts[prompt_id] = prompt
        self.runtime_state = state
        self.prompts: dict[str, fpb.PendingPrompt] = prompts
        # JSON forms persisted with every batch, recomputed only when they change.
        self._runtime_json: dict[str, Any] = binding.runtime_state
        self._prompts_json: dict[str, dict[str, Any]] = binding.pending_prompts
        self.attempts: dict[str, Attempt] = {}
        self.view = DeliveredView(self.commit_seq, fpb.RuntimeState(), {}, {})
        self.view.runtime_state.CopyFrom(state)
        self.view.prompts = dict(prompts)
        self._event_no = 0
        self._outbox: deque[_Outgoing] = deque()
        self._replay: deque[tuple[int, _Outgoing]] = deque(maxlen=limits.replay_frames)
        self._replay_bytes = 0
        self._subscribers: set[Subscription] = set()
        self._pending: list[persistence.PersistBatch] = []
        self._pending_bytes = 0
        # Reserved message ids not handed out yet: ascending blocks.
        self._ids: deque[range] = deque()
        self._accept = asyncio.Lock()
        self._wake_flusher = asyncio.Event()
        self._durable_advanced = asyncio.Event()
        self.failed_flushes = 0
        self.closed = False
        self._flusher = asyncio.create_task(self._flush_forever(), name=f"flusher-{session_id}")

    # Accepting work

    async def publish(
        self,
        rows: list[MessageRow],
        *,
        runtime_state: fpb.RuntimeState | None = None,
        prompts_upserted: list[fpb.PendingPrompt] | None = None,
        prompts_resolved: list[str] | None = None,
        events: list[fpb.RuntimeEvent] | None = None,
        terminal: bool = False,
        settles: fpb.AttemptRef | None = None,
        extra_metadata: dict[str, Any] | None = None,
        media_types: dict[str, str] | None = None,
        create_ms: int | None = None,
    ) -> tuple[int, list[int]]:
        """Accept one business batch (its messages created at `create_ms`, default now); returns
        its sequence and its messages' ids."""
        async with self._accept:
            self._check_open()
            cost = _backlog_cost(rows)
            self._check_backlog(cost)
            self._check_prompts(prompts_upserted or [], prompts_resolved or [])
            await self._ensure_ids(len(rows))
            if settles is not None:
                self._take_attempt(settles)
            return self._accept_now(
                rows,
                cost,
                runtime_state=runtime_state,
                prompts_upserted=prompts_upserted or [],
                prompts_resolved=prompts_resolved or [],
                events=events or [],
                terminal=terminal,
                settles=settles,
                extra_metadata=extra_metadata or {},
                media_types=media_types,
                create_ms=create_ms,
            )

    def _accept_now(
        self,
        rows: list[MessageRow],
        backlog_cost: int,
        *,
        runtime_state: fpb.RuntimeState | None,
        prompts_upserted: list[fpb.PendingPrompt],
        prompts_resolved: list[str],
        events: list[fpb.RuntimeEvent],
        terminal: bool,
        settles: fpb.AttemptRef | None,
        extra_metadata: dict[str, Any],
        media_types: dict[str, str] | None = None,
        create_ms: int | None = None,
    ) -> tuple[int, list[int]]:
        # Synchronous from here on: sequence, ids, state and fan-out change together.
        seq = self.commit_seq + 1
        created = self._clock.now_ms() if create_ms is None else create_ms
        session_id = self.session_id
        ids = self._take_ids(len(rows))
        # The validated rows become the stored rows. Once stored they are never changed in place.
        for message_id, row in zip(ids, rows, strict=True):
            row["message_id"] = message_id
            row["session_id"] = session_id
            row["deleted"] = False
            row["create_ms"] = created
            row["commit_seq"] = seq
            if extra_metadata:
                row["metadata"] = {**row["metadata"], **extra_metadata}
        stored = cast("list[dict[str, Any]]", rows)
        self.commit_seq = seq
        if runtime_state is not None:
            self.runtime_state = runtime_state
            self._runtime_json = json_format.MessageToDict(runtime_state)
        if prompts_upserted or prompts_resolved:
            for prompt in prompts_upserted:
                self.prompts[prompt.prompt_id] = prompt
            for resolved in prompts_resolved:
                self.prompts.pop(resolved, None)
            self._prompts_json = {k: json_format.MessageToDict(v) for k, v in self.prompts.items()}
        self._pending.append(
            persistence.PersistBatch(
                seq=seq,
                rows=stored,
                runtime_state=self._runtime_json,
                pending_prompts=self._prompts_json,
                backlog_bytes=backlog_cost,
            )
        )
        self._pending_bytes += backlog_cost
        self._wake_flusher.set()
        if stored or runtime_state is not None or prompts_upserted or prompts_resolved or events:
            batch = fpb.BatchFrame(
                base_seq=seq - 1,
                seq=seq,
                runtime_state=runtime_state,
                prompts_upserted=prompts_upserted,
                prompts_resolved=prompts_resolved,
                events=events,
                settles=settles,
            )
            frame = api.FollowResponse(stream_generation=self.stream_generation, batch=batch)
        else:
            watermark = fpb.WatermarkFrame(base_seq=seq - 1, seq=seq)
            frame = api.FollowResponse(stream_generation=self.stream_generation, watermark=watermark)
        # Small bodies travel in the frame while it has room; the rest as stubs (see bodies.py).
        whole = bodies.inline_ids([(row["message_id"], row["body_bytes"]) for row in stored], self._limits.bodies)
        shown = [row if row["message_id"] in whole else bodies.stub_row(row) for row in stored]
        cost = FRAME_OVERHEAD_BYTES + frame.ByteSize()
        cost += sum(row["body_bytes"] if row["message_id"] in whole else bodies.STUB_BYTES for row in stored)
        self._emit(frame, barrier=seq if terminal else 0, rows=shown or None, media_types=media_types, cost=cost)
        return seq, ids

    def open_attempt(self, ref: fpb.AttemptRef) -> None:
        """Open (or, with a higher attempt number, retry) a sampling attempt."""
        self._check_open()
        current = self.attempts.get(ref.message_key)
        if current is not None and current.ref.attempt >= ref.attempt:
            raise AttemptConflict(
                "a retry needs a higher attempt number than the open one",
                metadata={"attempt": current.ref.attempt},
            )
        if current is None and len(self.attempts) >= self._limits.max_open_attempts:
            raise TooManyOpenAttempts(
                f"at most {self._limits.max_open_attempts} sampling attempts may be open at once",
                metadata={"session_id": self.session_id, "max_open_attempts": self._limits.max_open_attempts},
            )
        self.attempts[ref.message_key] = Attempt(
            fpb.AttemptRef(message_key=ref.message_key, attempt=ref.attempt), active_ms=self._clock.now_ms()
        )
        self._emit(api.FollowResponse(stream_generation=self.stream_generation, attempt_opened=ref))

    def append_chunks(self, ref: fpb.AttemptRef, first_index: int, chunks: list[str]) -> int:
        """Show more chunks of an open attempt; indexes must continue exactly."""
        self._check_open()
        attempt = self._open(ref)
        if first_index != len(attempt.chunks):
            raise AttemptConflict(
                "chunk indexes must continue the attempt", metadata={"next_chunk_index": len(attempt.chunks)}
            )
        sizes = [bodies.utf8_size(text) for text in chunks]
        if attempt.text_bytes + sum(sizes) > self._limits.max_attempt_bytes:
            raise AttemptTooLarge(
                f"an attempt's text is limited to {self._limits.max_attempt_bytes} bytes, like the message it becomes",
                metadata={"message_key": attempt.ref.message_key, "text_bytes": attempt.text_bytes},
            )
        attempt.active_ms = self._clock.now_ms()
        for offset, (text, size) in enumerate(zip(chunks, sizes, strict=True)):
            attempt.chunks.append(text)
            attempt.text_bytes += size
            chunk = api.ChunkFrame(attempt=attempt.ref, chunk_index=first_index + offset, text=text)
            self._emit(
                api.FollowResponse(stream_generation=self.stream_generation, chunk=chunk),
                cost=FRAME_OVERHEAD_BYTES + size,
            )
        return len(attempt.chunks)

    async def commit_attempt(
        self, ref: fpb.AttemptRef, row: MessageRow, media_types: dict[str, str] | None = None
    ) -> tuple[int, int]:
        """Commit the attempt's complete message; its settlement follows once durable."""
        self._open(ref)
        seq, (message_id,) = await self.publish(
            [row],
            settles=ref,
            extra_metadata={"messageKey": ref.message_key, "attempt": ref.attempt},
            media_types=media_types,
        )
        self._settle(ref, seq, message_id, fpb.SETTLEMENT_OUTCOME_COMMITTED)
        return message_id, seq

    async def cancel_attempt(self, ref: fpb.AttemptRef) -> tuple[int, int]:
        """Store exactly the displayed partial output as an interrupted message, then settle."""
        async with self._accept:
            self._check_open()
            self._open(ref)
            await self._ensure_ids(1)
            # Read what was shown in the same synchronous step that ends the attempt, so no
            # chunk can slip in between. The stored message counts against the backlog like any
            # batch: refused, the attempt stays open for a retry.
            cost = self._open(ref).text_bytes + FRAME_OVERHEAD_BYTES
            self._check_backlog(cost)
            shown = "".join(self._take_attempt(ref).chunks)
            content = [{"text": shown}] if shown else []
            size = bodies.utf8_size(shown)
            row = message_row(pb.MESSAGE_ROLE_ASSISTANT, content, [], "", {}, pb.MESSAGE_STATUS_INTERRUPTED, size)
            seq, (message_id,) = self._accept_now(
                [row],
                cost,
                runtime_state=None,
                prompts_upserted=[],
                prompts_resolved=[],
                events=[],
                terminal=False,
                settles=ref,
                extra_metadata={"messageKey": ref.message_key, "attempt": ref.attempt},
            )
        self._settle(ref, seq, message_id, fpb.SETTLEMENT_OUTCOME_INTERRUPTED)
        return message_id, seq

    async def rewrite(self, change: Callable[[Any], Awaitable[Any]]) -> tuple[Any, int]:
        """Rewrite history: flush, run `change(connection)` and bump the stream generation in one
        transaction, then end every follower with resync(REWRITE). Returns `change`'s result and
        the new stream generation."""
        async with self._accept:
            self._check_open()
            await self.flush_until(self.commit_seq)
            async with self._db.transaction() as connection:
                result = await change(connection)
                stream_generation = await persistence.bump_stream_generation(
                    connection, self.session_id, self.stream_generation, self._clock.now_ms()
                )
                if stream_generation is None:
                    raise PublisherUnavailable(
                        "the session's live transcript moved; retry", metadata={"session_id": self.session_id}
                    )
            old = self.stream_generation
            self.stream_generation = stream_generation
            self.attempts.clear()
            self._replay.clear()
            self._replay_bytes = 0
            self.view.prefixes.clear()
            for subscriber in list(self._subscribers):
                subscriber.end(fpb.RESYNC_REASON_REWRITE, old, resumable=False)
            self._subscribers.clear()
            return result, stream_generation

    async def wait_durable(self, seq: int) -> None:
        """Return once everything up to `seq` is on disk."""
        while self.durable_seq < seq:
            self._check_open()
            self._durable_advanced.clear()
            await self._durable_advanced.wait()

    def _open(self, ref: fpb.AttemptRef) -> Attempt:
        attempt = self.attempts.get(ref.message_key)
        if attempt is None or attempt.ref.attempt != ref.attempt:
            raise AttemptConflict("no such open attempt", metadata={"message_key": ref.message_key})
        return attempt

    def _take_attempt(self, ref: fpb.AttemptRef) -> Attempt:
        attempt = self._open(ref)
        del self.attempts[ref.message_key]
        return attempt

    def _settle(self, ref: fpb.AttemptRef, seq: int, message_id: int, outcome: int) -> None:
        settlement = fpb.SettlementFrame(attempt=ref, seq=seq, message_id=message_id, outcome=outcome)  # type: ignore[arg-type]
        self._emit(api.FollowResponse(stream_generation=self.stream_generation, settlement=settlement), barrier=seq)

    def _check_backlog(self, cost: int) -> None:
        """Refuse a batch of `cost` bytes while unsaved batches fill the backlog (the database is slow
        or down)."""
        if self._pending and self._pending_bytes + cost > self._limits.backlog_bytes:
            raise PublishBacklogFull(
                "accepted messages are still waiting to be saved; retry later",
                metadata={"session_id": self.session_id, "durable_seq": self.durable_seq},
            )

    def _check_prompts(self, upserted: list[fpb.PendingPrompt], resolved: list[str]) -> None:
        """Refuse a batch that would leave more pending prompts than allowed (and more than now)."""
        after = (set(self.prompts) | {prompt.prompt_id for prompt in upserted}) - set(resolved)
        if len(after) > max(self._limits.max_pending_prompts, len(self.prompts)):
            raise TooManyPendingPrompts(
                f"at most {self._limits.max_pending_prompts} prompts may be pending at once",
                metadata={"session_id": self.session_id, "max_pending_prompts": self._limits.max_pending_prompts},
            )

    def _check_open(self) -> None:
        if self.closed:
            raise PublisherUnavailable(
                "the session's live transcript moved; retry", metadata={"session_id": self.session_id}
            )

    async def _ensure_ids(self, count: int) -> None:
        if sum(map(len, self._ids)) < count:
            self._ids.extend(await persistence.reserve_ids(self._db, max(count, self._limits.id_block)))

    def _take_ids(self, count: int) -> list[int]:
        """The next `count` reserved ids (`_ensure_ids` made sure there are as many)."""
        taken: list[int] = []
        while len(taken) < count:
            block = self._ids[0]
            wanted = count - len(taken)
            taken.extend(block[:wanted])
            if wanted >= len(block):
                self._ids.popleft()
            else:
                self._ids[0] = block[wanted:]
        return taken

    # Fan-out

    def _emit(
        self,
        frame: api.FollowResponse,
        barrier: int = 0,
        rows: list[dict[str, Any]] | None = None,
        media_types: dict[str, str] | None = None,
        cost: int = FRAME_OVERHEAD_BYTES,
    ) -> None:
        self._event_no += 1
        self._outbox.append(_Outgoing(self._event_no, barrier, frame, rows, media_types, cost))
        self._drain()

    def _drain(self) -> None:
        while self._outbox and self._outbox[0].barrier <= self.durable_seq:
            item = self._outbox.popleft()
            # The view needs no message bodies: the skeleton is enough.
            self.view.apply(item.skeleton)
            self.view.event_no = item.event_no
            kind = item.skeleton.WhichOneof("frame")
            if kind in ("batch", "watermark", "settlement"):
                self._remember(item)
            for subscriber in list(self._subscribers):
                subscriber.offer(item.event_no, item.frame, item.cost)
                if subscriber.ended:
                    self._subscribers.discard(subscriber)

    def _remember(self, item: _Outgoing) -> None:
        """Keep a replayable frame for resuming followers, within the window's frame and byte bounds."""
        if len(self._replay) == self._replay.maxlen:
            self._replay_bytes -= self._replay[0][1].cost
        self._replay.append((self.view.seq, item))
        self._replay_bytes += item.cost
        while len(self._replay) > 1 and self._replay_bytes > self._limits.replay_bytes:
            _, dropped = self._replay.popleft()
            self._replay_bytes -= dropped.cost

    def subscribe(self) -> tuple[Subscription, Cut]:
        """Register a bounded subscription and capture the delivered view, atomically."""
        self._check_open()
        subscription = Subscription(self._limits.queue_frames, self._limits.queue_bytes)
        self._subscribers.add(subscription)
        view = self.view
        cut = Cut(
            stream_generation=self.stream_generation,
            seq=view.seq,
            event_no=view.event_no,
            runtime_state=_copy(view.runtime_state),
            prompts=list(view.prompts.values()),
            prefixes=[(attempt.ref, tuple(attempt.chunks)) for attempt in view.prefixes.values()],
            replay=[item.frame for _, item in self._replay],
            replay_first_seq=self._replay[0][0] if self._replay else view.seq + 1,
        )
        return subscription, cut

    def unsubscribe(self, subscription: Subscription) -> None:
        """A follower left (a disconnect is never a cancel)."""
        self._subscribers.discard(subscription)

    @property
    def follower_count(self) -> int:
        """How many followers are attached."""
        return len(self._subscribers)

    def heartbeat(self, stream_generation: int) -> api.FollowResponse:
        """A liveness frame with the latest sequences, on a follower's `stream_generation`."""
        beat = fpb.HeartbeatFrame(commit_seq=self.commit_seq, durable_seq=self.durable_seq)
        return api.FollowResponse(stream_generation=stream_generation, heartbeat=beat)

    # Durability

    async def flush_until(self, seq: int) -> None:
        """Make sure everything accepted up to `seq` is durable (snapshots call this)."""
        self._wake_flusher.set()
        await self.wait_durable(seq)

    async def _flush_forever(self) -> None:
        delay = 0.05
        while not self.closed:
            await self._wake_flusher.wait()
            self._wake_flusher.clear()
            while self._pending and not self.closed:
                group = list(self._pending)
                try:
                    written = await persistence.persist(
                        self._db, self.session_id, self.stream_generation, group, self._clock.now_ms()
                    )
                except Exception as error:  # the database is down or failing: keep output, retry
                    self._report_failure(type(error).__name__)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 2.0)
                    continue
                if not written:
                    logger.warning(
                        "publisher fenced out",
                        extra={"session_id": self.session_id, "stream_generation": self.stream_generation},
                    )
                    self.close(fpb.RESYNC_REASON_REBIND)
                    return
                delay = 0.05
                del self._pending[: len(group)]
                self._pending_bytes = sum(batch.backlog_bytes for batch in self._pending)
                self._advance_durable(group[-1].seq)

    def _report_failure(self, reason: str) -> None:
        self.failed_flushes += 1
        logger.warning(
            "persisting the transcript failed; retrying",
            extra={
                "session_id": self.session_id,
                "reason": reason,
                "commit_seq": self.commit_seq,
                "durable_seq": self.durable_seq,
                "attempts": self.failed_flushes,
            },
        )
        failure = fpb.RecoveryFailureFrame(
            reason=reason, commit_seq=self.commit_seq, durable_seq=self.durable_seq, failed_attempts=self.failed_flushes
        )
        # Not through the outbox: the failure is news now, even behind a waiting barrier.
        self._broadcast(api.FollowResponse(stream_generation=self.stream_generation, recovery_failure=failure))

    def _advance_durable(self, seq: int) -> None:
        self.durable_seq = seq
        self._durable_advanced.set()
        if self.failed_flushes:
            self.failed_flushes = 0
            logger.info("persisting recovered", extra={"session_id": self.session_id, "durable_seq": seq})
            self._broadcast(
                api.FollowResponse(
                    stream_generation=self.stream_generation, recovered=fpb.RecoveredFrame(durable_seq=seq)
                )
            )
        self._drain()

    def _broadcast(self, frame: api.FollowResponse) -> None:
        for subscriber in list(self._subscribers):
            subscriber.offer(0, frame)

    # Ending

    def close(self, reason: int, *, resumable: bool = False) -> None:
        """Stop publishing: followers get a resync and the publisher leaves the registry."""
        if self.closed:
            return
        self.closed = True
        for subscriber in list(self._subscribers):
            subscriber.end(reason, self.stream_generation, resumable=resumable)
        self._subscribers.clear()
        self._durable_advanced.set()
        self._wake_flusher.set()
        self._on_closed(self)

    async def drain_and_close(self, reason: int, grace_seconds: float) -> None:
        """Flush what was accepted (bounded by `timeout`), then close."""
        if self._pending:
            try:
                await asyncio.wait_for(self.flush_until(self.commit_seq), grace_seconds)
            except (TimeoutError, PublisherUnavailable):
                logger.warning(
                    "closing with unpersisted batches",
                    extra={
                        "session_id": self.session_id,
                        "commit_seq": self.commit_seq,
                        "durable_seq": self.durable_seq,
                    },
                )
        self.close(reason)
        self._flusher.cancel()

    @property
    def idle(self) -> bool:
        """Nothing pending, nobody following, no attempt open but abandoned ones.

        An attempt whose runtime died is never committed or cancelled. Once it has shown nothing for
        the idle period it no longer keeps the publisher, which would otherwise live as long as the
        process: reaping drops its unsaved text, as the runtime's crash did (what was shown but never
        committed is not promised to survive)."""
        if self._pending or self._subscribers or self._outbox:
            return False
        quiet_since = self._clock.now_ms() - self._limits.abandoned_attempt_ms
        return all(attempt.active_ms <= quiet_since for attempt in self.attempts.values())


def _backlog_cost(rows: Sequence[MessageRow]) -> int:
    """What unsaved rows hold in memory, about: their bodies plus a little per row."""
    return sum(row["body_bytes"] for row in rows) + FRAME_OVERHEAD_BYTES * len(rows)


def _copy(state: fpb.RuntimeState) -> fpb.RuntimeState:
    copied = fpb.RuntimeState()
    copied.CopyFrom(state)
    return copied
