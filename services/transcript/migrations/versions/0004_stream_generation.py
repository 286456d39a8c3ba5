"""Name the publisher's epoch for what it is: the Follow stream generation

Revision ID: 0004
Revises: 0003
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # One name per concept: this epoch is the stream generation, not the history generation.
    with op.batch_alter_table("session_runtime", schema=None) as batch_op:
        batch_op.alter_column("generation", new_column_name="stream_generation")


def downgrade() -> None:
    with op.batch_alter_table("session_runtime", schema=None) as batch_op:
        batch_op.alter_column("stream_generation", new_column_name="generation")
