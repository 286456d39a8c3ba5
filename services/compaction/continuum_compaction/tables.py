"""Compaction's own tables (schema `compaction` on PostgreSQL, `compaction.db` on SQLite)."""

from __future__ import annotations

from sqlalchemy import BigInteger, Boolean, Column, Index, Integer, MetaData, String, Table, Text

metadata = MetaData()

# Times are epoch milliseconds (UTC), as in every Continuum service.
session_compactions = Table(
    "session_compactions",
    metadata,
    # One record per session: concurrent first inserts race on this key.
    Column("session_id", String(64), primary_key=True),
    Column("summary_text", Text, nullable=False),
    # The real id of the last message the summary covers; CAS writes are conditioned on it.
    Column("last_compacted_msg_id", BigInteger, nullable=False),
    Column("compact_count", Integer, nullable=False),
    Column("input_tokens", BigInteger, nullable=False),
    Column("output_tokens", BigInteger, nullable=False),
    Column("compact_model", String(200), nullable=False),
    Column("create_ms", BigInteger, nullable=False),
    Column("update_ms", BigInteger, nullable=False),
)

compaction_events = Table(
    "compaction_events",
    metadata,
    Column("event_id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("session_id", String(64), nullable=False),
    Column("run_id", String(128), nullable=False),
    Column("trigger_mode", String(32), nullable=False),
    Column("outcome", String(32), nullable=False),
    Column("boundary_before", BigInteger, nullable=False),
    Column("boundary_after", BigInteger, nullable=False),
    Column("tokens_before", BigInteger, nullable=False),
    Column("tokens_after", BigInteger, nullable=False),
    Column("model", String(200), nullable=False),
    Column("duration_ms", BigInteger, nullable=False),
    Column("batches_succeeded", Integer, nullable=False),
    Column("batches_failed", Integer, nullable=False),
    Column("facts_found", Integer, nullable=False),
    Column("facts_kept", Integer, nullable=False),
    # The summary this version produced, so the history of summaries stays readable.
    Column("summary_text", Text, nullable=True),
    Column("create_ms", BigInteger, nullable=False),
    Index("ix_compaction_events_session", "session_id", "event_id"),
    sqlite_autoincrement=True,
)

# A manual compaction queued for a running turn, bound to that turn's run id.
compaction_signals = Table(
    "compaction_signals",
    metadata,
    Column("session_id", String(64), primary_key=True),
    Column("run_id", String(128), nullable=False),
    Column("create_ms", BigInteger, nullable=False),
)

# The memory-injection choice of a session's current run: decided when the run starts and kept for
# all its requests, so turning the switch off takes effect from the next run (seed 004 §5.1).
run_choices = Table(
    "run_choices",
    metadata,
    Column("session_id", String(64), primary_key=True),
    Column("run_id", String(128), nullable=False),
    Column("inject_memory", Boolean, nullable=False),
    Column("create_ms", BigInteger, nullable=False),
)

# How far this service has consumed transcript's session events outbox.
event_cursors = Table(
    "event_cursors",
    metadata,
    Column("consumer", String(64), primary_key=True),
    Column("last_event_id", BigInteger, nullable=False),
    Column("update_ms", BigInteger, nullable=False),
)
