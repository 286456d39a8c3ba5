"""Merge operations (one active slot per user), units, attempts and the session-events cursor

Revision ID: 0001
Revises:
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "session_merges",
        sa.Column("operation_id", sa.String(length=64), nullable=False),
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("idempotency_key", sa.String(length=128), nullable=False),
        sa.Column("params_json", sa.Text(), nullable=False),
        sa.Column("target_session_id", sa.String(length=64), nullable=False),
        sa.Column("protocol_version", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("stage", sa.String(length=16), nullable=False),
        sa.Column("active_slot", sa.Integer(), nullable=True),
        sa.Column("run_epoch", sa.BigInteger(), nullable=False),
        sa.Column("execution_json", sa.Text(), nullable=False),
        sa.Column("cut_json", sa.Text(), nullable=True),
        sa.Column("claim_id", sa.String(length=64), nullable=True),
        sa.Column("locked_json", sa.Text(), nullable=True),
        sa.Column("claim_expire_ms", sa.BigInteger(), nullable=True),
        sa.Column("snapshot_version", sa.Integer(), nullable=False),
        sa.Column("snapshot_hash", sa.String(length=64), nullable=True),
        sa.Column("handoff_hash", sa.String(length=64), nullable=True),
        sa.Column("units_planned", sa.Boolean(), nullable=False),
        sa.Column("error_code", sa.String(length=32), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("retry_ms", sa.BigInteger(), nullable=True),
        sa.Column("lease_owner", sa.String(length=256), nullable=True),
        sa.Column("lease_expire_ms", sa.BigInteger(), nullable=True),
        sa.Column("create_ms", sa.BigInteger(), nullable=False),
        sa.Column("update_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("operation_id"),
        sa.UniqueConstraint("target_session_id"),
        sa.UniqueConstraint("owner", "idempotency_key", name="uq_session_merges_key"),
        sa.CheckConstraint(
            "status IN ('preparing', 'paused', 'failed', 'completed', 'cancelled')", name="ck_session_merges_status"
        ),
        sa.CheckConstraint(
            "stage IN ('snapshotting', 'extracting', 'aggregating', 'validating', 'publishing', 'completed')",
            name="ck_session_merges_stage",
        ),
        sa.CheckConstraint("protocol_version = 2", name="ck_session_merges_protocol"),
        sa.CheckConstraint("run_epoch >= 1", name="ck_session_merges_epoch"),
        sa.CheckConstraint("snapshot_version >= 0", name="ck_session_merges_snapshot_version"),
        sa.CheckConstraint(
            "(status IN ('preparing', 'paused', 'failed') AND active_slot IS NOT NULL AND active_slot = 1)"
            " OR (status IN ('completed', 'cancelled') AND active_slot IS NULL)",
            name="ck_session_merges_active_slot",
        ),
        sa.CheckConstraint(
            "status <> 'completed' OR (snapshot_hash IS NOT NULL AND handoff_hash IS NOT NULL AND stage = 'completed')",
            name="ck_session_merges_completed",
        ),
    )
    op.create_index(
        "uq_session_merges_active",
        "session_merges",
        ["owner"],
        unique=True,
        postgresql_where=sa.text("active_slot = 1"),
        sqlite_where=sa.text("active_slot = 1"),
    )
    op.create_index("ix_session_merges_work", "session_merges", ["status", "lease_expire_ms"])
    op.create_table(
        "session_merge_units",
        sa.Column("operation_id", sa.String(length=64), nullable=False),
        sa.Column("unit_id", sa.String(length=128), nullable=False),
        sa.Column("stage", sa.String(length=16), nullable=False),
        sa.Column("ordinal", sa.Integer(), nullable=False),
        sa.Column("input_hash", sa.String(length=64), nullable=False),
        sa.Column("input_json", sa.Text(), nullable=False),
        sa.Column("processor_version", sa.String(length=64), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("attempt_count", sa.Integer(), nullable=False),
        sa.Column("run_epoch", sa.BigInteger(), nullable=False),
        sa.Column("result_path", sa.String(length=256), nullable=True),
        sa.Column("result_hash", sa.String(length=64), nullable=True),
        sa.Column("error_code", sa.String(length=32), nullable=True),
        sa.Column("update_ms", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["operation_id"], ["session_merges.operation_id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("operation_id", "unit_id"),
        sa.CheckConstraint("stage IN ('extracting', 'aggregating')", name="ck_session_merge_units_stage"),
        sa.CheckConstraint(
            "state IN ('pending', 'running', 'completed', 'split', 'failed')", name="ck_session_merge_units_state"
        ),
        sa.CheckConstraint("attempt_count >= 0", name="ck_session_merge_units_attempts"),
        sa.CheckConstraint(
            "state <> 'completed' OR (result_path IS NOT NULL AND result_hash IS NOT NULL)",
            name="ck_session_merge_units_result",
        ),
    )
    op.create_index(
        "ix_session_merge_units_next", "session_merge_units", ["operation_id", "stage", "state", "ordinal", "unit_id"]
    )
    op.create_table(
        "session_merge_attempts",
        sa.Column("request_id", sa.String(length=64), nullable=False),
        sa.Column("operation_id", sa.String(length=64), nullable=False),
        sa.Column("unit_id", sa.String(length=128), nullable=False),
        sa.Column("run_epoch", sa.BigInteger(), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("start_ms", sa.BigInteger(), nullable=False),
        sa.Column("finish_ms", sa.BigInteger(), nullable=True),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.Column("input_tokens", sa.BigInteger(), nullable=True),
        sa.Column("output_tokens", sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(["operation_id"], ["session_merges.operation_id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("request_id"),
        sa.CheckConstraint(
            "outcome IN ('running', 'completed', 'error', 'cancelled', 'unknown')",
            name="ck_session_merge_attempts_outcome",
        ),
    )
    op.create_index(
        "ix_session_merge_attempts_operation", "session_merge_attempts", ["operation_id", "unit_id", "start_ms"]
    )
    op.create_table(
        "event_cursors",
        sa.Column("consumer", sa.String(length=64), nullable=False),
        sa.Column("last_event_id", sa.BigInteger(), nullable=False),
        sa.Column("update_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("consumer"),
    )


def downgrade() -> None:
    op.drop_table("event_cursors")
    op.drop_index("ix_session_merge_attempts_operation", table_name="session_merge_attempts")
    op.drop_table("session_merge_attempts")
    op.drop_index("ix_session_merge_units_next", table_name="session_merge_units")
    op.drop_table("session_merge_units")
    op.drop_index("ix_session_merges_work", table_name="session_merges")
    op.drop_index("uq_session_merges_active", table_name="session_merges")
    op.drop_table("session_merges")
