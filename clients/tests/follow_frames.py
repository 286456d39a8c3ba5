"""Builders of Follow frames and messages for the client tests (importable as `follow_frames`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from continuum.compaction.events.v1 import events_pb2
from continuum.transcript.v1 import follow_pb2 as fpb
from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum_follow.store import Outcome, RecordStore

GEN = 3
Frame = api.FollowResponse


def message(
    message_id: int,
    text: str,
    role: pb.MessageRole.ValueType = pb.MESSAGE_ROLE_USER,
    *,
    tool_calls: Sequence[str] = (),
    tool_call_id: str = "",
    status: pb.MessageStatus.ValueType = pb.MESSAGE_STATUS_COMPLETE,
) -> pb.Message:
    """A committed message; `tool_calls` names the calls an ASSISTANT message issues."""
    return pb.Message(
        message_id=message_id,
        session_id="s",
        role=role,
        content=[pb.ContentPart(text=text)] if text else [],
        tool_calls=[pb.ToolCall(tool_call_id=c, name="shell", arguments='{"cmd": "ls"}') for c in tool_calls],
        tool_call_id=tool_call_id,
        status=status,
    )


def ref(key: str, attempt: int = 1) -> fpb.AttemptRef:
    """An attempt identity."""
    return fpb.AttemptRef(message_key=key, attempt=attempt)


def prefix(key: str, attempt: int, text: str, next_chunk_index: int) -> fpb.ActivePrefix:
    """An active prefix as snapshots carry it."""
    return fpb.ActivePrefix(attempt=ref(key, attempt), next_chunk_index=next_chunk_index, text=text)


def handshake(mode: fpb.FollowMode.ValueType, stream_generation: int = GEN, durable_seq: int = 0) -> Frame:
    """The first frame of a stream."""
    return Frame(
        stream_generation=stream_generation,
        handshake=fpb.HandshakeFrame(protocol="transcript-v2", mode=mode, durable_seq=durable_seq),
    )


def baseline(
    seq: int,
    messages: Iterable[pb.Message] = (),
    *,
    prefixes: Iterable[fpb.ActivePrefix] = (),
    state: fpb.RunState.ValueType = fpb.RUN_STATE_IDLE,
    prompts: Iterable[str] = (),
    stream_generation: int = GEN,
    durable_seq: int | None = None,
) -> list[Frame]:
    """A whole BASELINE stream opening: handshake, snapshot parts, end."""
    durable = seq if durable_seq is None else durable_seq
    frames = [
        handshake(fpb.FOLLOW_MODE_BASELINE, stream_generation, durable),
        Frame(stream_generation=stream_generation, snapshot_begin=fpb.SnapshotBeginFrame(seq=seq, durable_seq=durable)),
        Frame(stream_generation=stream_generation, snapshot_records=fpb.SnapshotRecordsFrame(messages=list(messages))),
        Frame(
            stream_generation=stream_generation,
            snapshot_runtime=fpb.SnapshotRuntimeFrame(
                runtime_state=fpb.RuntimeState(state=state),
                prompts=[fpb.PendingPrompt(prompt_id=p, kind=fpb.PROMPT_KIND_APPROVAL) for p in prompts],
            ),
        ),
    ]
    frames += [Frame(stream_generation=stream_generation, snapshot_prefix=p) for p in prefixes]
    frames.append(Frame(stream_generation=stream_generation, snapshot_end=fpb.SnapshotEndFrame(seq=seq)))
    return frames


def resume(prefixes: Iterable[fpb.ActivePrefix] = (), stream_generation: int = GEN) -> list[Frame]:
    """A RESUME stream opening: handshake and the active prefixes."""
    return [handshake(fpb.FOLLOW_MODE_RESUME, stream_generation)] + [
        Frame(stream_generation=stream_generation, snapshot_prefix=p) for p in prefixes
    ]


def marker_event(tag: int) -> fpb.RuntimeEvent:
    """A runtime event told apart from others by `tag` (a compaction marker's event id)."""
    return fpb.RuntimeEvent(compaction_marker=events_pb2.CompactionMarker(event_id=tag))


def batch(
    base_seq: int,
    seq: int,
    messages: Iterable[pb.Message] = (),
    *,
    settles: fpb.AttemptRef | None = None,
    state: fpb.RunState.ValueType | None = None,
    upsert: Iterable[str] = (),
    resolve: Iterable[str] = (),
    events: Iterable[int] = (),
    stream_generation: int = GEN,
) -> Frame:
    """A business batch."""
    frame = fpb.BatchFrame(
        base_seq=base_seq,
        seq=seq,
        messages=list(messages),
        prompts_upserted=[fpb.PendingPrompt(prompt_id=p, kind=fpb.PROMPT_KIND_QUESTION) for p in upsert],
        prompts_resolved=list(resolve),
        events=[marker_event(tag) for tag in events],
    )
    if settles is not None:
        frame.settles.CopyFrom(settles)
    if state is not None:
        frame.runtime_state.state = state
    return Frame(stream_generation=stream_generation, batch=frame)


def watermark(base_seq: int, seq: int, stream_generation: int = GEN) -> Frame:
    """An invisible batch."""
    return Frame(stream_generation=stream_generation, watermark=fpb.WatermarkFrame(base_seq=base_seq, seq=seq))


def opened(key: str, attempt: int = 1, stream_generation: int = GEN) -> Frame:
    """An attempt (or a retry) opened."""
    return Frame(stream_generation=stream_generation, attempt_opened=ref(key, attempt))


def chunk(key: str, attempt: int, index: int, text: str, stream_generation: int = GEN) -> Frame:
    """One streamed chunk."""
    return Frame(
        stream_generation=stream_generation,
        chunk=api.ChunkFrame(attempt=ref(key, attempt), chunk_index=index, text=text),
    )


def settlement(
    key: str,
    attempt: int,
    seq: int,
    message_id: int,
    outcome: fpb.SettlementOutcome.ValueType = fpb.SETTLEMENT_OUTCOME_COMMITTED,
    stream_generation: int = GEN,
) -> Frame:
    """An attempt's settlement."""
    settled = fpb.SettlementFrame(attempt=ref(key, attempt), seq=seq, message_id=message_id, outcome=outcome)
    return Frame(stream_generation=stream_generation, settlement=settled)


def heartbeat(commit_seq: int, durable_seq: int, stream_generation: int = GEN) -> Frame:
    """A liveness frame."""
    return Frame(
        stream_generation=stream_generation,
        heartbeat=fpb.HeartbeatFrame(commit_seq=commit_seq, durable_seq=durable_seq),
    )


def resync(reason: fpb.ResyncReason.ValueType, resumable: bool, stream_generation: int = GEN) -> Frame:
    """The last frame of a stream."""
    return Frame(stream_generation=stream_generation, resync=fpb.ResyncFrame(reason=reason, resumable=resumable))


def apply_all(store: RecordStore, frames: Iterable[Frame]) -> list[Outcome]:
    """Apply frames in order; their outcomes."""
    return [store.apply(frame) for frame in frames]


def texts(store: RecordStore) -> list[str]:
    """The committed messages' texts, in order."""
    return ["".join(part.text for part in m.content) for m in store.ordered_messages()]
