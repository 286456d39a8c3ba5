"""Compaction records, events, manual signals, run choices and the session-events cursor

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
        "session_compactions",
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("summary_text", sa.Text(), nullable=False),
        sa.Column("last_compacted_msg_id", sa.BigInteger(), nullable=False),
        sa.Column("compact_count", sa.Integer(), nullable=False),
        sa.Column("input_tokens", sa.BigInteger(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("compact_model", sa.String(length=200), nullable=False),
        sa.Column("create_ms", sa.BigInteger(), nullable=False),
        sa.Column("update_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("session_id"),
    )
    op.create_table(
        "compaction_events",
        sa.Column("event_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("trigger_mode", sa.String(length=32), nullable=False),
        sa.Column("outcome", sa.String(length=32), nullable=False),
        sa.Column("boundary_before", sa.BigInteger(), nullable=False),
        sa.Column("boundary_after", sa.BigInteger(), nullable=False),
        sa.Column("tokens_before", sa.BigInteger(), nullable=False),
        sa.Column("tokens_after", sa.BigInteger(), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("duration_ms", sa.BigInteger(), nullable=False),
        sa.Column("batches_succeeded", sa.Integer(), nullable=False),
        sa.Column("batches_failed", sa.Integer(), nullable=False),
        sa.Column("facts_found", sa.Integer(), nullable=False),
        sa.Column("facts_kept", sa.Integer(), nullable=False),
        sa.Column("summary_text", sa.Text(), nullable=True),
        sa.Column("create_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("event_id"),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_compaction_events_session", "compaction_events", ["session_id", "event_id"])
    op.create_table(
        "compaction_signals",
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("create_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("session_id"),
    )
    op.create_table(
        "run_choices",
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("inject_memory", sa.Boolean(), nullable=False),
        sa.Column("create_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("session_id"),
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
    op.drop_table("run_choices")
    op.drop_table("compaction_signals")
    op.drop_index("ix_compaction_events_session", table_name="compaction_events")
    op.drop_table("compaction_events")
    op.drop_table("session_compactions")
