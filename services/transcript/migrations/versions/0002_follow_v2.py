"""Follow v2: publisher runtime state, message commit sequences, derived turn index

Revision ID: 0002
Revises: 0001
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.add_column(sa.Column("commit_seq", sa.BigInteger(), server_default="0", nullable=False))
    op.create_table(
        "session_runtime",
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("durable_seq", sa.BigInteger(), nullable=False),
        sa.Column("runtime_state", sa.JSON(), nullable=False),
        sa.Column("pending_prompts", sa.JSON(), nullable=False),
        sa.Column("update_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("session_id"),
    )
    op.create_table(
        "turns",
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("turn", sa.Integer(), nullable=False),
        sa.Column("prompt_message_id", sa.BigInteger(), nullable=False),
        sa.Column("position", sa.BigInteger(), nullable=False),
        sa.Column("prompt_preview", sa.Text(), nullable=False),
        sa.Column("answer_preview", sa.Text(), nullable=True),
        sa.Column("final_message_id", sa.BigInteger(), nullable=True),
        sa.Column("started_ms", sa.BigInteger(), nullable=False),
        sa.Column("finished_ms", sa.BigInteger(), nullable=True),
        sa.Column("sampling_count", sa.Integer(), nullable=True),
        sa.Column("tool_call_count", sa.Integer(), nullable=True),
        sa.Column("commit_seq", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("session_id", "turn"),
    )
    op.create_table(
        "turn_index_state",
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("coverage_seq", sa.BigInteger(), nullable=False),
        sa.Column("update_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("session_id"),
    )


def downgrade() -> None:
    op.drop_table("turn_index_state")
    op.drop_table("turns")
    op.drop_table("session_runtime")
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.drop_column("commit_seq")
