"""Merge's own tables (schema `merge` on PostgreSQL, `merge.db` on SQLite); appendix A of seed 000,
for a service of many users: the active slot and the idempotency key are unique per user."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    UniqueConstraint,
    text,
)

metadata = MetaData()

STATUSES = ("preparing", "paused", "failed", "completed", "cancelled")
STAGES = ("snapshotting", "extracting", "aggregating", "validating", "publishing", "completed")
UNIT_STATES = ("pending", "running", "completed", "split", "failed")
ATTEMPT_OUTCOMES = ("running", "completed", "error", "cancelled", "unknown")


def _one_of(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(value) for value in values)})"


# Times are epoch milliseconds (UTC), as in every Continuum service.
session_merges = Table(
    "session_merges",
    metadata,
    Column("operation_id", String(64), primary_key=True),
    Column("owner", String(128), nullable=False),
    Column("idempotency_key", String(128), nullable=False),
    # The request as given (sources in request order, primary, title, model): MergeParameters as JSON.
    Column("params_json", Text, nullable=False),
    # Reserved at start; the session with this id exists only once the operation is completed.
    Column("target_session_id", String(64), nullable=False, unique=True),
    Column("protocol_version", Integer, nullable=False),
    Column("status", String(16), nullable=False),
    Column("stage", String(16), nullable=False),
    # 1 while the operation is unfinished (preparing, paused, failed), NULL once completed or cancelled;
    # a unique partial index makes it the user's one active slot.
    Column("active_slot", Integer, nullable=True),
    # Bumped whenever a run is superseded (resume, cancel, takeover); every worker write is fenced by it.
    Column("run_epoch", BigInteger, nullable=False),
    # Captured at start: resolved model, target title, working directory, the primary's model.
    Column("execution_json", Text, nullable=False),
    # The source cut recorded at admission (each root: its tree's sessions and last message ids).
    Column("cut_json", Text, nullable=True),
    # The MERGE claim on the source trees while it is held (until the seal), and the roots it locks.
    Column("claim_id", String(64), nullable=True),
    Column("locked_json", Text, nullable=True),
    Column("claim_expire_ms", BigInteger, nullable=True),
    Column("snapshot_version", Integer, nullable=False),
    Column("snapshot_hash", String(64), nullable=True),
    Column("handoff_hash", String(64), nullable=True),
    # True once every unit is planned (the known count is then the total).
    Column("units_planned", Boolean, nullable=False),
    Column("error_code", String(32), nullable=True),
    Column("error", Text, nullable=True),
    Column("retry_ms", BigInteger, nullable=True),
    # Consecutive resumes of a PACKAGE_DAMAGED pause: damage still found after one is confirmed
    # unrecoverable (seed 000 §6.3: paused for diagnosis, failed only once confirmed).
    Column("damage_resumes", Integer, nullable=False, server_default="0"),
    # The worker lease: which replica works on the operation, until when unless renewed.
    Column("lease_owner", String(256), nullable=True),
    Column("lease_expire_ms", BigInteger, nullable=True),
    Column("create_ms", BigInteger, nullable=False),
    Column("update_ms", BigInteger, nullable=False),
    # When what a cancelled operation left (claims, a target a beaten publish created, its directory)
    # was removed; the sweeper looks only at cancelled operations without it.
    Column("cleaned_ms", BigInteger, nullable=True),
    UniqueConstraint("owner", "idempotency_key", name="uq_session_merges_key"),
    CheckConstraint(_one_of("status", STATUSES), name="ck_session_merges_status"),
    CheckConstraint(_one_of("stage", STAGES), name="ck_session_merges_stage"),
    CheckConstraint("protocol_version = 2", name="ck_session_merges_protocol"),
    CheckConstraint("run_epoch >= 1", name="ck_session_merges_epoch"),
    CheckConstraint("snapshot_version >= 0", name="ck_session_merges_snapshot_version"),
    # `active_slot = 1` with NULL in the other branch: a NULL must not satisfy the unfinished branch.
    CheckConstraint(
        "(status IN ('preparing', 'paused', 'failed') AND active_slot IS NOT NULL AND active_slot = 1)"
        " OR (status IN ('completed', 'cancelled') AND active_slot IS NULL)",
        name="ck_session_merges_active_slot",
    ),
    CheckConstraint(
        "status <> 'completed' OR (snapshot_hash IS NOT NULL AND handoff_hash IS NOT NULL AND stage = 'completed')",
        name="ck_session_merges_completed",
    ),
    Index(
        "uq_session_merges_active",
        "owner",
        unique=True,
        postgresql_where=text("active_slot = 1"),
        sqlite_where=text("active_slot = 1"),
    ),
    Index("ix_session_merges_work", "status", "lease_expire_ms"),
    Index(
        "ix_session_merges_uncleaned",
        "operation_id",
        postgresql_where=text("status = 'cancelled' AND cleaned_ms IS NULL"),
        sqlite_where=text("status = 'cancelled' AND cleaned_ms IS NULL"),
    ),
)

session_merge_units = Table(
    "session_merge_units",
    metadata,
    Column("operation_id", String(64), ForeignKey("session_merges.operation_id", ondelete="CASCADE"), nullable=False),
    Column("unit_id", String(128), nullable=False),
    Column("stage", String(16), nullable=False),
    Column("ordinal", Integer, nullable=False),
    Column("input_hash", String(64), nullable=False),
    # Bounded input references only (record refs, child unit ids of a split parent).
    Column("input_json", Text, nullable=False),
    Column("processor_version", String(64), nullable=False),
    Column("model", String(200), nullable=False),
    Column("state", String(16), nullable=False),
    Column("attempt_count", Integer, nullable=False),
    Column("run_epoch", BigInteger, nullable=False),
    # Relative to the operation's directory.
    Column("result_path", String(256), nullable=True),
    Column("result_hash", String(64), nullable=True),
    Column("error_code", String(32), nullable=True),
    Column("update_ms", BigInteger, nullable=False),
    PrimaryKeyConstraint("operation_id", "unit_id"),
    CheckConstraint("stage IN ('extracting', 'aggregating')", name="ck_session_merge_units_stage"),
    CheckConstraint(_one_of("state", UNIT_STATES), name="ck_session_merge_units_state"),
    CheckConstraint("attempt_count >= 0", name="ck_session_merge_units_attempts"),
    CheckConstraint(
        "state <> 'completed' OR (result_path IS NOT NULL AND result_hash IS NOT NULL)",
        name="ck_session_merge_units_result",
    ),
    Index("ix_session_merge_units_next", "operation_id", "stage", "state", "ordinal", "unit_id"),
)

# One row per model request of a unit: its own terminal outcome and usage, so a failed or cancelled
# call is still accounted for and a late answer never changes a unit's state.
session_merge_attempts = Table(
    "session_merge_attempts",
    metadata,
    Column("request_id", String(64), primary_key=True),
    Column("operation_id", String(64), ForeignKey("session_merges.operation_id", ondelete="CASCADE"), nullable=False),
    Column("unit_id", String(128), nullable=False),
    Column("run_epoch", BigInteger, nullable=False),
    Column("model", String(200), nullable=False),
    Column("start_ms", BigInteger, nullable=False),
    Column("finish_ms", BigInteger, nullable=True),
    Column("outcome", String(16), nullable=False),
    # Unknown usage stays NULL (never zero).
    Column("input_tokens", BigInteger, nullable=True),
    Column("output_tokens", BigInteger, nullable=True),
    CheckConstraint(_one_of("outcome", ATTEMPT_OUTCOMES), name="ck_session_merge_attempts_outcome"),
    Index("ix_session_merge_attempts_operation", "operation_id", "unit_id", "start_ms"),
)

# How far this service has consumed transcript's session events outbox.
event_cursors = Table(
    "event_cursors",
    metadata,
    Column("consumer", String(64), primary_key=True),
    Column("last_event_id", BigInteger, nullable=False),
    Column("update_ms", BigInteger, nullable=False),
)
