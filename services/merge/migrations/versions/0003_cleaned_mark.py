"""Cancelled operations cleaned: the sweeper looks only at those not cleaned yet

Revision ID: 0003
Revises: 0002
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_UNCLEANED = "status = 'cancelled' AND cleaned_ms IS NULL"


def upgrade() -> None:
    with op.batch_alter_table("session_merges", schema=None) as batch_op:
        batch_op.add_column(sa.Column("cleaned_ms", sa.BigInteger(), nullable=True))
    op.create_index(
        "ix_session_merges_uncleaned",
        "session_merges",
        ["operation_id"],
        unique=False,
        postgresql_where=sa.text(_UNCLEANED),
        sqlite_where=sa.text(_UNCLEANED),
    )


def downgrade() -> None:
    op.drop_index(
        "ix_session_merges_uncleaned",
        table_name="session_merges",
        postgresql_where=sa.text(_UNCLEANED),
        sqlite_where=sa.text(_UNCLEANED),
    )
    with op.batch_alter_table("session_merges", schema=None) as batch_op:
        batch_op.drop_column("cleaned_ms")
