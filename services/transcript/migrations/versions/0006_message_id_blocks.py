"""Message ids in blocks: one nextval reserves a publisher a whole block of ids

Revision ID: 0006
Revises: 0005
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# A frozen copy of continuum_transcript.persistence.ID_BLOCK as of this revision.
ID_BLOCK = 8192


def _increment_by(step: int) -> None:
    # SQLite reserves through sqlite_sequence, by any count, and needs nothing.
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            "DO $$ BEGIN EXECUTE format('ALTER SEQUENCE %s INCREMENT BY "
            f"{step}', pg_get_serial_sequence('messages', 'message_id')); END $$"
        )


def upgrade() -> None:
    # The next value is the last one handed out plus a block, so ids stay increasing across the change.
    _increment_by(ID_BLOCK)


def downgrade() -> None:
    _increment_by(1)
