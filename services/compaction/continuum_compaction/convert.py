"""Stored compaction rows as API messages: one conversion for reads and for Follow announcements."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from google.protobuf import duration_pb2, timestamp_pb2

from continuum.compaction.events.v1 import events_pb2
from continuum.compaction.v1 import resources_pb2 as pb
from continuum_compaction import store


def trigger_name(mode: events_pb2.TriggerMode.ValueType) -> str:
    """`request_start`, `mid_loop` or `manual`, as stored."""
    return events_pb2.TriggerMode.Name(mode).removeprefix("TRIGGER_MODE_").lower()


def outcome_name(outcome: events_pb2.CompactionOutcome.ValueType) -> str:
    """`compacted`, `conflict`, ... as stored."""
    return events_pb2.CompactionOutcome.Name(outcome).removeprefix("COMPACTION_OUTCOME_").lower()


def _duration(ms: int) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromMilliseconds(ms)
    return duration


def _timestamp(ms: int) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromMilliseconds(ms)
    return stamp


def summary_message(record: store.CompactionRecord) -> pb.CompactionSummary:
    """The API view of a stored summary."""
    return pb.CompactionSummary(
        session_id=record.session_id,
        summary_text=record.summary_text,
        last_compacted_message_id=record.last_compacted_msg_id,
        compact_count=record.compact_count,
        model=record.compact_model,
        input_tokens=record.input_tokens,
        output_tokens=record.output_tokens,
        create_time=_timestamp(record.create_ms),
        update_time=_timestamp(record.update_ms),
    )


def event_message(row: Mapping[str, Any], *, include_summary: bool) -> pb.CompactionEvent:
    """The API view of a stored event row (summary text only when asked for: it can be long)."""
    return pb.CompactionEvent(
        event_id=row["event_id"],
        session_id=row["session_id"],
        trigger_mode=events_pb2.TriggerMode.Value(f"TRIGGER_MODE_{row['trigger_mode'].upper()}"),
        outcome=events_pb2.CompactionOutcome.Value(f"COMPACTION_OUTCOME_{row['outcome'].upper()}"),
        boundary_before=row["boundary_before"],
        boundary_after=row["boundary_after"],
        estimated_tokens_before=row["tokens_before"],
        estimated_tokens_after=row["tokens_after"],
        model=row["model"],
        duration=_duration(row["duration_ms"]),
        batches_succeeded=row["batches_succeeded"],
        batches_failed=row["batches_failed"],
        facts_found=row["facts_found"],
        facts_kept=row["facts_kept"],
        summary_text=(row["summary_text"] or "") if include_summary else "",
        run_id=row["run_id"],
        create_time=_timestamp(row["create_ms"]),
    )
