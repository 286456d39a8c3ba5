"""Message body sizes, stored previews and truncation flags: stubs never read a body

Revision ID: 0005
Revises: 0004
"""

import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of the rules in continuum_transcript.bodies as of this revision: a migration must
# keep doing what it did when it was written, whatever the code does later.
PREVIEW_CHARS = 200
STORED_PREVIEW_BYTES = 4096
# Rows read per statement; bodies up to SMALL_BYTES are read together, larger ones one at a time.
BATCH_ROWS = 500
SMALL_BYTES = 64 * 1024
_WORD = re.compile(r"\S+")

messages = sa.table(
    "messages",
    sa.column("message_id", sa.BigInteger()),
    sa.column("role", sa.Integer()),
    sa.column("content", sa.JSON()),
    sa.column("tool_calls", sa.JSON()),
    sa.column("metadata", sa.JSON()),
    sa.column("body_bytes", sa.BigInteger()),
    sa.column("preview", sa.Text()),
    sa.column("result_truncated", sa.Boolean()),
)


def upgrade() -> None:
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.add_column(sa.Column("body_bytes", sa.BigInteger(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("preview", sa.Text(), server_default="", nullable=False))
        batch_op.add_column(sa.Column("result_truncated", sa.Boolean(), server_default=sa.false(), nullable=False))
    _backfill(op.get_bind())


def downgrade() -> None:
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.drop_column("result_truncated")
        batch_op.drop_column("preview")
        batch_op.drop_column("body_bytes")


def _backfill(connection: sa.Connection) -> None:
    """Every existing row's size, preview and flag, a bounded batch at a time: ids and raw sizes
    first, then small bodies together and large ones singly, so memory never holds more than
    BATCH_ROWS small bodies or one large one."""
    raw = sa.func.length(sa.cast(messages.c.content, sa.Text)) + sa.func.length(sa.cast(messages.c.tool_calls, sa.Text))
    after = 0
    while True:
        batch = connection.execute(
            sa.select(messages.c.message_id, raw.label("raw"))
            .where(messages.c.message_id > after)
            .order_by(messages.c.message_id)
            .limit(BATCH_ROWS)
        ).all()
        if not batch:
            return
        small = [row.message_id for row in batch if (row.raw or 0) <= SMALL_BYTES]
        large = [row.message_id for row in batch if (row.raw or 0) > SMALL_BYTES]
        updates = [_values(row) for row in _bodies(connection, small)]
        for message_id in large:
            updates += [_values(row) for row in _bodies(connection, [message_id])]
        if updates:
            connection.execute(
                sa.update(messages)
                .where(messages.c.message_id == sa.bindparam("id"))
                .values(
                    body_bytes=sa.bindparam("body_bytes"),
                    preview=sa.bindparam("preview"),
                    result_truncated=sa.bindparam("result_truncated"),
                ),
                updates,
            )
        after = batch[-1].message_id


def _bodies(connection: sa.Connection, ids: list[int]) -> Sequence[sa.Row[Any, Any, Any, Any]]:
    if not ids:
        return []
    columns = (messages.c.message_id, messages.c.content, messages.c.tool_calls, messages.c.metadata)
    return connection.execute(sa.select(*columns).where(messages.c.message_id.in_(ids))).all()


def _values(row: sa.Row[Any, Any, Any, Any]) -> dict[str, Any]:
    content = row.content if isinstance(row.content, list) else []
    calls = row.tool_calls if isinstance(row.tool_calls, list) else []
    metadata = row.metadata if isinstance(row.metadata, dict) else {}
    size = sum(len(text.encode()) for text in _texts(content))
    size += sum(len(str(call.get("arguments", "")).encode()) for call in calls if isinstance(call, dict))
    size += len(json.dumps(metadata).encode()) if metadata else 0
    return {
        "id": row.message_id,
        "body_bytes": size,
        "preview": _preview(content) if size > STORED_PREVIEW_BYTES else "",
        "result_truncated": metadata.get("resultTruncated") is True,
    }


def _texts(content: list[Any]) -> Iterable[str]:
    for part in content:
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            yield part["text"]


def _preview(content: list[Any]) -> str:
    words: list[str] = []
    size = -1
    for text in _texts(content):
        for match in _WORD.finditer(text):
            words.append(match.group())
            size += len(words[-1]) + 1
            if size > PREVIEW_CHARS:
                return " ".join(words)[: PREVIEW_CHARS - 1].rstrip() + "…"
    return " ".join(words)
