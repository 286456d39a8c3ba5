"""Transcript's own tables (schema `transcript` on PostgreSQL, `transcript.db` on SQLite)."""

from __future__ import annotations

from sqlalchemy import JSON, BigInteger, Boolean, Column, Index, Integer, MetaData, String, Table, Text
from sqlalchemy import false as sa_false

# Plain JSON (text) rather than JSONB: we never query inside it, and PostgreSQL's jsonb refuses
# U+0000, which real tool output contains.
JsonColumn = JSON

metadata = MetaData()

# Times are epoch milliseconds (UTC): identical on both backends and cheap to compare.
sessions = Table(
    "sessions",
    metadata,
    Column("session_id", String(64), primary_key=True),
    Column("owner", String(128), nullable=False),
    Column("parent_session_id", String(64), nullable=True),
    Column("root_session_id", String(64), nullable=False),
    Column("kind", Integer, nullable=False),
    Column("title", Text, nullable=False),
    Column("model", Text, nullable=False),
    Column("working_directory", Text, nullable=False),
    Column("memory_injection_disabled", Boolean, nullable=False),
    Column("metadata", JsonColumn, nullable=False),
    # Fingerprint of the create parameters: a retried create with the same id must match it.
    Column("create_fingerprint", String(64), nullable=False),
    Column("history_generation", BigInteger, nullable=False),
    Column("deleted", Boolean, nullable=False),
    Column("create_ms", BigInteger, nullable=False),
    Column("update_ms", BigInteger, nullable=False),
    Column("delete_ms", BigInteger, nullable=True),
    # Compaction's summary covers every message up to this id (0: none). Kept here, on the row
    # edits lock to bump history_generation, so the edit guard needs no call to compaction.
    Column("compaction_fence_message_id", BigInteger, nullable=False, server_default="0"),
    Index("ix_sessions_owner_created", "owner", "deleted", "create_ms", "session_id"),
    Index("ix_sessions_root", "root_session_id"),
    Index("ix_sessions_parent", "parent_session_id"),
)

messages = Table(
    "messages",
    metadata,
    Column("message_id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("session_id", String(64), nullable=False),
    Column("role", Integer, nullable=False),
    Column("content", JsonColumn, nullable=False),
    Column("tool_calls", JsonColumn, nullable=False),
    Column("tool_call_id", String(256), nullable=False),
    Column("metadata", JsonColumn, nullable=False),
    Column("status", Integer, nullable=False),
    Column("deleted", Boolean, nullable=False),
    Column("create_ms", BigInteger, nullable=False),
    # The business sequence of the batch that committed the message (0 before Follow v2).
    Column("commit_seq", BigInteger, nullable=False, server_default="0"),
    # Written with the body so stubs and previews never read it (see bodies.py): its approximate
    # size in bytes, its preview when it is too large to read for one, and the truncation flag.
    Column("body_bytes", BigInteger, nullable=False, server_default="0"),
    Column("preview", Text, nullable=False, server_default=""),
    Column("result_truncated", Boolean, nullable=False, server_default=sa_false()),
    Index("ix_messages_session_deleted_id", "session_id", "deleted", "message_id"),
    # Never reuse an id on SQLite either: compaction boundaries are real message ids.
    sqlite_autoincrement=True,
)

attachments = Table(
    "attachments",
    metadata,
    Column("attachment_id", String(64), primary_key=True),
    Column("session_id", String(64), nullable=False, index=True),
    Column("owner", String(128), nullable=False),
    Column("media_type", String(255), nullable=False),
    Column("file_name", String(255), nullable=False),
    Column("size_bytes", BigInteger, nullable=False),
    Column("sha256", String(64), nullable=False),
    Column("create_ms", BigInteger, nullable=False),
)

# One row per locked tree: a claim on any session locks its whole tree through the root.
execution_claims = Table(
    "execution_claims",
    metadata,
    Column("root_session_id", String(64), primary_key=True),
    Column("claim_id", String(64), nullable=False, index=True),
    Column("kind", Integer, nullable=False),
    Column("holder", String(256), nullable=False),
    Column("owner", String(128), nullable=False),
    Column("session_ids", JsonColumn, nullable=False),
    # How many trees the claim locked; a renewal that finds fewer rows lost part of its claim.
    Column("root_count", Integer, nullable=False),
    Column("acquire_ms", BigInteger, nullable=False),
    Column("expire_ms", BigInteger, nullable=False),
)

session_events = Table(
    "session_events",
    metadata,
    Column("event_id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("event_type", Integer, nullable=False),
    Column("session_id", String(64), nullable=False),
    Column("root_session_id", String(64), nullable=False),
    Column("owner", String(128), nullable=False),
    Column("payload", JsonColumn, nullable=False),
    Column("create_ms", BigInteger, nullable=False),
    sqlite_autoincrement=True,
)

# The live publisher's persisted state: its stream generation (epoch) and the durable prefix.
session_runtime = Table(
    "session_runtime",
    metadata,
    Column("session_id", String(64), primary_key=True),
    # Bumped on every publisher (re)bind and history rewrite; never goes back.
    Column("stream_generation", BigInteger, nullable=False),
    Column("durable_seq", BigInteger, nullable=False),
    Column("runtime_state", JsonColumn, nullable=False),
    Column("pending_prompts", JsonColumn, nullable=False),
    Column("update_ms", BigInteger, nullable=False),
)

# Derived turn index: disposable, rebuildable from the messages (see turns.py).
turns = Table(
    "turns",
    metadata,
    Column("session_id", String(64), primary_key=True),
    Column("turn", Integer, primary_key=True),
    Column("prompt_message_id", BigInteger, nullable=False),
    Column("position", BigInteger, nullable=False),
    Column("prompt_preview", Text, nullable=False),
    Column("answer_preview", Text, nullable=True),
    Column("final_message_id", BigInteger, nullable=True),
    Column("started_ms", BigInteger, nullable=False),
    Column("finished_ms", BigInteger, nullable=True),
    Column("sampling_count", Integer, nullable=True),
    Column("tool_call_count", Integer, nullable=True),
    Column("commit_seq", BigInteger, nullable=False),
)

turn_index_state = Table(
    "turn_index_state",
    metadata,
    Column("session_id", String(64), primary_key=True),
    # The derived-schema version the rows were built with; a newer code version rebuilds.
    Column("version", Integer, nullable=False),
    # The business sequence the index covers.
    Column("coverage_seq", BigInteger, nullable=False),
    Column("update_ms", BigInteger, nullable=False),
)
