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

ID_BLOCK = 8192
_SEQUENCE = "pg_get_serial_sequence('messages', 'message_id')"


def upgrade() -> None:
    # SQLite reserves through sqlite_sequence, by any count, and needs nothing. The next value is the
    # last one handed out plus a block, so ids stay increasing across the change.
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DO $$ BEGIN EXECUTE format('ALTER SEQUENCE %s INCREMENT BY {ID_BLOCK}', {_SEQUENCE}); END $$")


def downgrade() -> None:
    # The last value handed out starts a block that may be in use up to its end: counting by one again
    # starts after it.
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            "DO $$ DECLARE sequence text := "
            f"{_SEQUENCE}; BEGIN"
            " EXECUTE format('SELECT setval(%L, (SELECT last_value FROM %s) + "
            f"{ID_BLOCK - 1})', sequence, sequence);"
            " EXECUTE format('ALTER SEQUENCE %s INCREMENT BY 1', sequence); END $$"
        )
