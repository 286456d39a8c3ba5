"""Resumes of a package found damaged: a damage still there after one is confirmed unrecoverable

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
    with op.batch_alter_table("session_merges", schema=None) as batch_op:
        batch_op.add_column(sa.Column("damage_resumes", sa.Integer(), server_default="0", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("session_merges", schema=None) as batch_op:
        batch_op.drop_column("damage_resumes")
