"""initial transcript tables

Revision ID: 0001
Revises:
Create Date: 2026-11-30 00:31:50.532807
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# JSON text, not JSONB: jsonb refuses U+0000, which real tool output contains.
JSON_TYPE = sa.JSON()

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "attachments",
        sa.Column("attachment_id", sa.String(length=64), nullable=False),
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("media_type", sa.String(length=255), nullable=False),
        sa.Column("file_name", sa.String(length=255), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("create_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("attachment_id"),
    )
    with op.batch_alter_table("attachments", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_attachments_session_id"), ["session_id"], unique=False)

    op.create_table(
        "execution_claims",
        sa.Column("root_session_id", sa.String(length=64), nullable=False),
        sa.Column("claim_id", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.Integer(), nullable=False),
        sa.Column("holder", sa.String(length=256), nullable=False),
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("session_ids", JSON_TYPE, nullable=False),
        sa.Column("root_count", sa.Integer(), nullable=False),
        sa.Column("acquire_ms", sa.BigInteger(), nullable=False),
        sa.Column("expire_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("root_session_id"),
    )
    with op.batch_alter_table("execution_claims", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_execution_claims_claim_id"), ["claim_id"], unique=False)

    op.create_table(
        "messages",
        sa.Column(
            "message_id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("role", sa.Integer(), nullable=False),
        sa.Column("content", JSON_TYPE, nullable=False),
        sa.Column("tool_calls", JSON_TYPE, nullable=False),
        sa.Column("tool_call_id", sa.String(length=256), nullable=False),
        sa.Column("metadata", JSON_TYPE, nullable=False),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("deleted", sa.Boolean(), nullable=False),
        sa.Column("create_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("message_id"),
        sqlite_autoincrement=True,
    )
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.create_index("ix_messages_session_deleted_id", ["session_id", "deleted", "message_id"], unique=False)

    op.create_table(
        "session_events",
        sa.Column(
            "event_id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("event_type", sa.Integer(), nullable=False),
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("root_session_id", sa.String(length=64), nullable=False),
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("payload", JSON_TYPE, nullable=False),
        sa.Column("create_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("event_id"),
        sqlite_autoincrement=True,
    )
    op.create_table(
        "sessions",
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("parent_session_id", sa.String(length=64), nullable=True),
        sa.Column("root_session_id", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.Integer(), nullable=False),
        sa.Column("title", sa.Text(), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("working_directory", sa.Text(), nullable=False),
        sa.Column("memory_injection_disabled", sa.Boolean(), nullable=False),
        sa.Column("metadata", JSON_TYPE, nullable=False),
        sa.Column("create_fingerprint", sa.String(length=64), nullable=False),
        sa.Column("history_generation", sa.BigInteger(), nullable=False),
        sa.Column("deleted", sa.Boolean(), nullable=False),
        sa.Column("create_ms", sa.BigInteger(), nullable=False),
        sa.Column("update_ms", sa.BigInteger(), nullable=False),
        sa.Column("delete_ms", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("session_id"),
    )
    with op.batch_alter_table("sessions", schema=None) as batch_op:
        batch_op.create_index(
            "ix_sessions_owner_created", ["owner", "deleted", "create_ms", "session_id"], unique=False
        )
        batch_op.create_index("ix_sessions_parent", ["parent_session_id"], unique=False)
        batch_op.create_index("ix_sessions_root", ["root_session_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("sessions", schema=None) as batch_op:
        batch_op.drop_index("ix_sessions_root")
        batch_op.drop_index("ix_sessions_parent")
        batch_op.drop_index("ix_sessions_owner_created")

    op.drop_table("sessions")
    op.drop_table("session_events")
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.drop_index("ix_messages_session_deleted_id")

    op.drop_table("messages")
    with op.batch_alter_table("execution_claims", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_execution_claims_claim_id"))

    op.drop_table("execution_claims")
    with op.batch_alter_table("attachments", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_attachments_session_id"))

    op.drop_table("attachments")
