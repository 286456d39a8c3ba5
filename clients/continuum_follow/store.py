"""The record store a follower keeps: committed messages, tool calls, active prefixes, runtime state.

Pure state, no I/O. `RecordStore.apply` takes the Follow frames of one stream in order and answers
whether each was applied, ignored (a duplicate or a stale attempt) or demands a resync. A baseline
snapshot is collected frame by frame and installed in one step at its end, so a reader never sees
half of one; a resume keeps the records and replaces every active prefix at once.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from continuum.transcript.v1 import follow_pb2 as fpb
from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum_runtime.wire_names import TRANSCRIPT_V2

PROTOCOL = TRANSCRIPT_V2
DEFAULT_EVENT_LIMIT = 200
# Committed messages a store keeps (the newest): three pages of 32, as the seed's client keeps.
DEFAULT_MESSAGE_LIMIT = 96

# Reasons of resyncs the store decides itself; the server's reasons are its enum names in
# lowercase ("overflow", "rewrite", ...).
CHAIN_GAP = "chain_gap"
CHUNK_GAP = "chunk_gap"
UNKNOWN_ATTEMPT = "unknown_attempt"
INVALID_SETTLEMENT = "invalid_settlement"
GENERATION_CHANGED = "generation_changed"
OUT_OF_ORDER = "out_of_order"

_STATUS_FRAMES = frozenset({"heartbeat", "recovery_failure", "recovered"})
_SNAPSHOT_FRAMES = frozenset(
    {"snapshot_begin", "snapshot_records", "snapshot_runtime", "snapshot_prefix", "snapshot_end"}
)


class Status(enum.Enum):
    """What applying one frame did."""

    APPLIED = "applied"
    IGNORED = "ignored"
    RESYNC = "resync"


@dataclass(frozen=True)
class Outcome:
    """The answer of `RecordStore.apply`. For a resync, `reason` says why and `resumable` whether
    re-following with the applied cursor may resume (otherwise only a fresh baseline will do)."""

    status: Status
    reason: str = ""
    resumable: bool = False

    @classmethod
    def applied(cls) -> Outcome:
        """The frame changed (or confirmed) the store."""
        return _APPLIED

    @classmethod
    def ignored(cls, reason: str) -> Outcome:
        """The frame was harmless and skipped (a duplicate, a stale attempt)."""
        return cls(Status.IGNORED, reason)

    @classmethod
    def resync(cls, reason: str, *, resumable: bool = False) -> Outcome:
        """The stream is over for this store; follow again."""
        return cls(Status.RESYNC, reason, resumable)


_APPLIED = Outcome(Status.APPLIED)


def resync_reason(reason: int) -> str:
    """The server's resync reason as a short lowercase name ("overflow", "rewrite", ...)."""
    try:
        name = fpb.ResyncReason.Name(reason)  # type: ignore[arg-type]
    except ValueError:
        return f"reason_{reason}"
    return name.removeprefix("RESYNC_REASON_").lower()


@dataclass(frozen=True)
class Cursor:
    """The applied position: the stream generation of the installed baseline and the last applied seq."""

    stream_generation: int
    seq: int


@dataclass(frozen=True)
class Prefix:
    """The streamed text of an open sampling attempt: chunks 0..next_chunk_index-1."""

    message_key: str
    attempt: int
    next_chunk_index: int
    text: str


@dataclass(frozen=True)
class ToolRecord:
    """A tool call and its result, joined by the call id (either side may be outside the loaded page)."""

    tool_call_id: str
    call: pb.ToolCall | None = None
    call_message_id: int | None = None
    result_message_id: int | None = None


@dataclass(frozen=True)
class RecoveryFailure:
    """Saving failed on the server: visible output stays, durability lags until `recovered`."""

    reason: str
    failed_attempts: int
    commit_seq: int
    durable_seq: int


@dataclass(frozen=True)
class Snapshot:
    """Everything a baseline installs at once."""

    stream_generation: int
    seq: int
    durable_seq: int
    messages: Sequence[pb.Message] = ()
    has_older: bool = False
    history: fpb.HistoryCursor | None = None
    runtime_state: fpb.RuntimeState = field(default_factory=fpb.RuntimeState)
    prompts: Sequence[fpb.PendingPrompt] = ()
    prefixes: Sequence[fpb.ActivePrefix] = ()


class _Phase(enum.Enum):
    BASELINE = "baseline"  # collecting snapshot frames until snapshot_end
    RESUME_PREFIXES = "resume_prefixes"  # collecting the prefixes that follow a RESUME handshake
    LIVE = "live"  # applying suffix frames


@dataclass
class _Stream:
    """What the store knows about the stream in progress."""

    stream_generation: int
    phase: _Phase
    durable_seq: int
    begin: fpb.SnapshotBeginFrame | None = None
    records: fpb.SnapshotRecordsFrame | None = None
    runtime: fpb.SnapshotRuntimeFrame | None = None
    prefixes: list[fpb.ActivePrefix] = field(default_factory=list)


class RecordStore:
    """One session's transcript as a follower sees it."""

    def __init__(self, event_limit: int = DEFAULT_EVENT_LIMIT, message_limit: int = DEFAULT_MESSAGE_LIMIT) -> None:
        if message_limit < 1:
            raise ValueError("a store keeps at least one message")
        self._message_limit = message_limit
        self._messages: dict[int, pb.Message] = {}
        self._tools: dict[str, ToolRecord] = {}
        self._prefixes: dict[str, Prefix] = {}
        self._runtime_state = fpb.RuntimeState()
        self._prompts: dict[str, fpb.PendingPrompt] = {}
        self._events: deque[fpb.RuntimeEvent] = deque(maxlen=event_limit)
        self._settlements: dict[int, fpb.SettlementOutcome.ValueType] = {}
        self._cursor: Cursor | None = None
        self._durable_seq = 0
        self._has_older = False
        self._history: fpb.HistoryCursor | None = None
        self.recovery_failure: RecoveryFailure | None = None
        self._stream: _Stream | None = None

    # Reading

    @property
    def cursor(self) -> Cursor | None:
        """Where a resume continues from; None until a baseline was installed."""
        return self._cursor

    @property
    def live(self) -> bool:
        """A baseline is installed and the current stream is past its snapshot or resume prefixes."""
        return self._cursor is not None and self._stream is not None and self._stream.phase is _Phase.LIVE

    @property
    def durable_seq(self) -> int:
        """The server's persisted prefix of the business sequence, as last reported."""
        return self._durable_seq

    @property
    def messages(self) -> Mapping[int, pb.Message]:
        """Committed messages by id: the newest `message_limit` of those seen (older ones are left to
        history pages, see `history`). A message may be a stub (`body_deferred`): load its body by id."""
        return self._messages

    def ordered_messages(self) -> list[pb.Message]:
        """Committed messages in id (conversation) order."""
        return [self._messages[message_id] for message_id in sorted(self._messages)]

    @property
    def tools(self) -> Mapping[str, ToolRecord]:
        """Tool calls and their results by tool call id."""
        return self._tools

    @property
    def prefixes(self) -> Mapping[str, Prefix]:
        """Active (streaming) attempts by message key."""
        return self._prefixes

    @property
    def runtime_state(self) -> fpb.RuntimeState:
        """What the agent runtime is doing."""
        return self._runtime_state

    @property
    def prompts(self) -> Mapping[str, fpb.PendingPrompt]:
        """Approvals and questions waiting for the user, by prompt id."""
        return self._prompts

    @property
    def events(self) -> Sequence[fpb.RuntimeEvent]:
        """The most recent runtime events (bounded), oldest first."""
        return tuple(self._events)

    @property
    def settlements(self) -> Mapping[int, fpb.SettlementOutcome.ValueType]:
        """How settled attempts ended, by the id of the message that settled them."""
        return self._settlements

    @property
    def has_older(self) -> bool:
        """Whether history older than the loaded page exists (see `history`)."""
        return self._has_older

    @property
    def history(self) -> fpb.HistoryCursor | None:
        """Where paging to older history continues, pinned to the baseline's cut."""
        return self._history

    # Installing

    def install_snapshot(self, snapshot: Snapshot) -> None:
        """Replace records, runtime state, prompts and active prefixes in one step."""
        self._cursor = Cursor(snapshot.stream_generation, snapshot.seq)
        self._has_older = snapshot.has_older
        self._history = snapshot.history
        self._messages = {}
        self._tools = {}
        self._settlements = {}
        # After the cursor and history: a page larger than the store's limit evicts, and moves them.
        for message in snapshot.messages:
            self._put_message(message)
        self._runtime_state = _copy_state(snapshot.runtime_state)
        self._prompts = {prompt.prompt_id: prompt for prompt in snapshot.prompts}
        self._prefixes = {}
        self._install_prefixes(snapshot.prefixes)
        self._durable_seq = snapshot.durable_seq
        # A snapshot is read after the server flushed up to its cut, so any earlier failure is over.
        self.recovery_failure = None

    def end_stream(self) -> None:
        """The stream ended (disconnect, error, stop): drop whatever it had not installed yet."""
        self._stream = None

    # Applying

    def apply(self, frame: api.FollowResponse) -> Outcome:
        """Apply one frame of the current stream (a handshake starts a new one)."""
        kind = frame.WhichOneof("frame")
        if kind is None:
            # A frame kind this client does not know: a newer server's addition, safe to skip.
            return Outcome.ignored("unknown frame")
        if kind == "handshake":
            return self._handshake(frame.stream_generation, frame.handshake)
        stream = self._stream
        if stream is None:
            return self._fail(OUT_OF_ORDER)
        if kind == "resync":
            self._stream = None
            return Outcome.resync(resync_reason(frame.resync.reason), resumable=frame.resync.resumable)
        if frame.stream_generation != stream.stream_generation:
            return self._fail(GENERATION_CHANGED)
        if stream.phase is _Phase.BASELINE:
            if kind in _STATUS_FRAMES:
                return self._status_during_baseline(stream, frame)
            return self._snapshot_part(stream, frame)
        if stream.phase is _Phase.RESUME_PREFIXES:
            if kind == "snapshot_prefix":
                return self._collect_prefix(stream, frame.snapshot_prefix)
            # Rule: the prefixes that follow a RESUME handshake replace all active prefixes
            # together, when the first frame that is not one of them arrives.
            self._prefixes = {}
            self._install_prefixes(stream.prefixes)
            stream.prefixes = []
            stream.phase = _Phase.LIVE
        if kind in _SNAPSHOT_FRAMES:
            return self._fail(OUT_OF_ORDER)
        return self._suffix(frame)

    def _handshake(self, stream_generation: int, handshake: fpb.HandshakeFrame) -> Outcome:
        if handshake.mode == fpb.FOLLOW_MODE_BASELINE:
            self._stream = _Stream(stream_generation, _Phase.BASELINE, handshake.durable_seq)
            return Outcome.applied()
        if handshake.mode == fpb.FOLLOW_MODE_RESUME:
            # The server resumes only a cursor of its current stream generation; anything else means the
            # cursor it answered is not ours.
            if self._cursor is None or self._cursor.stream_generation != stream_generation:
                return self._fail(GENERATION_CHANGED)
            self._stream = _Stream(stream_generation, _Phase.RESUME_PREFIXES, handshake.durable_seq)
            self._durable_seq = max(self._durable_seq, handshake.durable_seq)
            return Outcome.applied()
        return self._fail(OUT_OF_ORDER)

    def _snapshot_part(self, stream: _Stream, frame: api.FollowResponse) -> Outcome:
        kind = frame.WhichOneof("frame")
        if kind == "snapshot_begin":
            if stream.begin is not None:
                return self._fail(OUT_OF_ORDER)
            stream.begin = frame.snapshot_begin
            stream.durable_seq = max(stream.durable_seq, frame.snapshot_begin.durable_seq)
            return Outcome.applied()
        if stream.begin is None:
            return self._fail(OUT_OF_ORDER)
        if kind == "snapshot_records" and stream.records is None:
            stream.records = frame.snapshot_records
        elif kind == "snapshot_runtime" and stream.runtime is None:
            stream.runtime = frame.snapshot_runtime
        elif kind == "snapshot_prefix":
            return self._collect_prefix(stream, frame.snapshot_prefix)
        elif kind == "snapshot_end":
            return self._end_snapshot(stream, frame.stream_generation, frame.snapshot_end)
        else:
            # A repeated part, or a suffix frame before the snapshot ended.
            return self._fail(OUT_OF_ORDER)
        return Outcome.applied()

    def _end_snapshot(self, stream: _Stream, stream_generation: int, end: fpb.SnapshotEndFrame) -> Outcome:
        begin, records, runtime = stream.begin, stream.records, stream.runtime
        if begin is None or records is None or runtime is None or end.seq != begin.seq:
            return self._fail(OUT_OF_ORDER)
        self.install_snapshot(
            Snapshot(
                stream_generation=stream_generation,
                seq=begin.seq,
                durable_seq=stream.durable_seq,
                messages=list(records.messages),
                has_older=records.has_older,
                history=records.history if records.HasField("history") else None,
                runtime_state=runtime.runtime_state,
                prompts=list(runtime.prompts),
                prefixes=stream.prefixes,
            )
        )
        self._stream = _Stream(stream_generation, _Phase.LIVE, stream.durable_seq)
        return Outcome.applied()

    def _collect_prefix(self, stream: _Stream, piece: fpb.ActivePrefix) -> Outcome:
        """Gather a piece of an active prefix; a piece that does not continue the one before is a gap."""
        if piece.first_chunk_index:
            previous = stream.prefixes[-1] if stream.prefixes else None
            if (
                previous is None
                or previous.attempt != piece.attempt
                or previous.next_chunk_index != piece.first_chunk_index
            ):
                return self._fail(CHUNK_GAP)
        stream.prefixes.append(piece)
        return Outcome.applied()

    def _status_during_baseline(self, stream: _Stream, frame: api.FollowResponse) -> Outcome:
        # The records on show are still the previous baseline's; only remember the news for the install.
        kind = frame.WhichOneof("frame")
        if kind == "heartbeat":
            stream.durable_seq = max(stream.durable_seq, frame.heartbeat.durable_seq)
        elif kind == "recovered":
            stream.durable_seq = max(stream.durable_seq, frame.recovered.durable_seq)
        return Outcome.applied()

    def _suffix(self, frame: api.FollowResponse) -> Outcome:
        cursor = self._cursor
        if cursor is None:  # unreachable: LIVE implies an installed baseline
            return self._fail(OUT_OF_ORDER)
        kind = frame.WhichOneof("frame")
        if kind == "batch":
            return self._batch(cursor, frame.batch)
        if kind == "watermark":
            return self._advance(cursor, frame.watermark.base_seq, frame.watermark.seq)
        if kind == "attempt_opened":
            return self._attempt_opened(frame.attempt_opened)
        if kind == "chunk":
            return self._chunk(frame.chunk)
        if kind == "settlement":
            return self._settlement(cursor, frame.settlement)
        if kind == "heartbeat":
            self._durable_seq = max(self._durable_seq, frame.heartbeat.durable_seq)
            if self.recovery_failure is not None and frame.heartbeat.durable_seq >= frame.heartbeat.commit_seq:
                # Everything accepted is on disk: the failure is over even if `recovered` was missed.
                self.recovery_failure = None
            return Outcome.applied()
        if kind == "recovery_failure":
            failure = frame.recovery_failure
            self.recovery_failure = RecoveryFailure(
                failure.reason, failure.failed_attempts, failure.commit_seq, failure.durable_seq
            )
            self._durable_seq = max(self._durable_seq, failure.durable_seq)
            return Outcome.applied()
        if kind == "recovered":
            self.recovery_failure = None
            self._durable_seq = max(self._durable_seq, frame.recovered.durable_seq)
            return Outcome.applied()
        return Outcome.ignored("unknown frame")

    def _advance(self, cursor: Cursor, base_seq: int, seq: int) -> Outcome:
        if seq <= cursor.seq:
            return Outcome.ignored("duplicate")
        if base_seq != cursor.seq:
            return self._fail(CHAIN_GAP)
        self._cursor = Cursor(cursor.stream_generation, seq)
        return Outcome.applied()

    def _batch(self, cursor: Cursor, batch: fpb.BatchFrame) -> Outcome:
        chained = self._advance(cursor, batch.base_seq, batch.seq)
        if chained.status is not Status.APPLIED:
            return chained
        for message in batch.messages:
            self._put_message(message)
        if batch.HasField("runtime_state"):
            self._runtime_state = _copy_state(batch.runtime_state)
        for prompt in batch.prompts_upserted:
            self._prompts[prompt.prompt_id] = prompt
        for prompt_id in batch.prompts_resolved:
            self._prompts.pop(prompt_id, None)
        self._events.extend(batch.events)
        if batch.HasField("settles"):
            self._drop_prefix(batch.settles)
        return Outcome.applied()

    def _attempt_opened(self, ref: fpb.AttemptRef) -> Outcome:
        current = self._prefixes.get(ref.message_key)
        if current is not None and current.attempt >= ref.attempt:
            return Outcome.ignored("stale attempt")
        # A higher attempt of an open key is a retry: its text starts over.
        self._prefixes[ref.message_key] = Prefix(ref.message_key, ref.attempt, 0, "")
        return Outcome.applied()

    def _chunk(self, chunk: api.ChunkFrame) -> Outcome:
        current = self._prefixes.get(chunk.attempt.message_key)
        if current is None or chunk.attempt.attempt > current.attempt:
            # We never saw this attempt open: frames were lost.
            return self._fail(UNKNOWN_ATTEMPT)
        if chunk.attempt.attempt < current.attempt:
            return Outcome.ignored("stale attempt")
        if chunk.chunk_index < current.next_chunk_index:
            return Outcome.ignored("duplicate chunk")
        if chunk.chunk_index > current.next_chunk_index:
            return self._fail(CHUNK_GAP)
        self._prefixes[current.message_key] = replace(
            current, next_chunk_index=current.next_chunk_index + 1, text=current.text + chunk.text
        )
        return Outcome.applied()

    def _settlement(self, cursor: Cursor, settlement: fpb.SettlementFrame) -> Outcome:
        # A settlement follows the batch that committed its message; anything else is a mispairing.
        if settlement.seq > cursor.seq or settlement.message_id not in self._messages:
            return self._fail(INVALID_SETTLEMENT)
        self._settlements[settlement.message_id] = settlement.outcome
        self._durable_seq = max(self._durable_seq, settlement.seq)
        self._drop_prefix(settlement.attempt)
        return Outcome.applied()

    # Helpers

    def _fail(self, reason: str) -> Outcome:
        # The store cannot trust the rest of this stream; the follower gets a fresh baseline.
        self._stream = None
        return Outcome.resync(reason)

    def _put_message(self, message: pb.Message) -> None:
        if message.deleted:
            self._messages.pop(message.message_id, None)
            return
        self._messages[message.message_id] = message
        if len(self._messages) > self._message_limit:
            self._evict_oldest()
        for call in message.tool_calls:
            known = self._tools.get(call.tool_call_id, ToolRecord(call.tool_call_id))
            self._tools[call.tool_call_id] = replace(known, call=call, call_message_id=message.message_id)
        if message.role == pb.MESSAGE_ROLE_TOOL and message.tool_call_id:
            known = self._tools.get(message.tool_call_id, ToolRecord(message.tool_call_id))
            self._tools[message.tool_call_id] = replace(known, result_message_id=message.message_id)

    def _install_prefixes(self, prefixes: Iterable[fpb.ActivePrefix]) -> None:
        # Pieces were checked to continue each other as they arrived (`_collect_prefix`).
        texts: dict[str, list[str]] = {}
        for prefix in prefixes:
            key = prefix.attempt.message_key
            if not prefix.first_chunk_index:
                texts[key] = []
            texts[key].append(prefix.text)
            self._prefixes[key] = Prefix(key, prefix.attempt.attempt, prefix.next_chunk_index, "")
        for key, parts in texts.items():
            self._prefixes[key] = replace(self._prefixes[key], text="".join(parts))

    def _evict_oldest(self) -> None:
        """Forget the oldest message (and its tool links): it stays reachable through history pages,
        which continue before the oldest message kept, at the sequence the store has applied."""
        oldest = min(self._messages)
        evicted = self._messages.pop(oldest)
        for call in evicted.tool_calls:
            known = self._tools.get(call.tool_call_id)
            if known is not None and known.call_message_id == oldest:
                self._tools.pop(call.tool_call_id)
        if evicted.role == pb.MESSAGE_ROLE_TOOL:
            known = self._tools.get(evicted.tool_call_id)
            if known is not None and known.result_message_id == oldest:
                self._tools.pop(evicted.tool_call_id)
        self._settlements.pop(oldest, None)
        self._has_older = True
        if self._cursor is not None:
            self._history = fpb.HistoryCursor(
                stream_generation=self._cursor.stream_generation,
                snapshot_sequence=self._cursor.seq,
                before_message_id=min(self._messages),
            )

    def _drop_prefix(self, ref: fpb.AttemptRef) -> None:
        current = self._prefixes.get(ref.message_key)
        if current is not None and current.attempt == ref.attempt:
            del self._prefixes[ref.message_key]


def _copy_state(state: fpb.RuntimeState) -> fpb.RuntimeState:
    copied = fpb.RuntimeState()
    copied.CopyFrom(state)
    return copied
