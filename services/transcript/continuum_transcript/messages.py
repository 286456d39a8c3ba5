"""Message store: atomic batch append, reads after a boundary, pages around an anchor, edits."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson
from sqlalchemy import ColumnElement, RowMapping, Text, case, cast, null, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from continuum.transcript.v1 import resources_pb2 as pb
from continuum_transcript import bodies, convert, events, sessions
from continuum_transcript.errors import (
    AttachmentNotFound,
    HistoryGenerationMismatch,
    MessageAlreadyCompacted,
    MessageNotEditable,
    MessageNotFound,
)
from continuum_transcript.tables import attachments, messages
from continuum_transcript.validation import attachment_ids


async def attachment_media_types(connection: AsyncConnection, session_id: str, referenced: list[str]) -> dict[str, str]:
    """Media types of the attachments new content refers to; each must belong to this session."""
    if not referenced:
        return {}
    known = await _media_types(connection, referenced, attachments.c.session_id == session_id)
    missing = sorted(set(referenced) - set(known))
    if missing:
        raise AttachmentNotFound(
            "content refers to attachments not uploaded to this session",
            metadata={"session_id": session_id, "attachment_id": missing[0]},
        )
    return known


async def with_media_types(connection: AsyncConnection, rows: Sequence[Mapping[Any, Any]]) -> list[pb.Message]:
    """Stored rows (or stubs) as Message resources, with the media types of the attachments they refer to."""
    known = await media_types_of(connection, rows)
    return [convert.message(row, known) for row in rows]


async def media_types_of(connection: AsyncConnection, rows: Sequence[Mapping[Any, Any]]) -> dict[str, str]:
    """The media types of the attachments stored rows (not stubs) refer to, by attachment id."""
    wanted = sorted(
        {
            attachment_id
            for row in rows
            if not row.get("body_deferred")
            for attachment_id in attachment_ids(row["content"])
        }
    )
    return await _media_types(connection, wanted) if wanted else {}


async def _media_types(connection: AsyncConnection, ids: list[str], *conditions: ColumnElement[bool]) -> dict[str, str]:
    found = await connection.execute(
        select(attachments.c.attachment_id, attachments.c.media_type).where(
            attachments.c.attachment_id.in_(ids), *conditions
        )
    )
    return {attachment_id: media_type for attachment_id, media_type in found}


async def get(connection: AsyncConnection, owner: str, session_id: str, message_id: int) -> RowMapping:
    """One message of the session, deleted or not; NOT_FOUND if it is in another session."""
    await sessions.load(connection, owner, session_id, include_deleted=True)
    return await _find(connection, session_id, message_id)


async def _find(connection: AsyncConnection, session_id: str, message_id: int) -> RowMapping:
    """`get` for a caller that already loaded (and so checked) the session."""
    row = (
        (
            await connection.execute(
                select(messages).where(messages.c.message_id == message_id, messages.c.session_id == session_id)
            )
        )
        .mappings()
        .first()
    )
    if row is None:
        raise MessageNotFound(
            "no such message in this session", metadata={"session_id": session_id, "message_id": message_id}
        )
    return row


# A session's messages in id order, spelled as the (session_id, deleted, message_id) index orders them.
# Ordering by message_id alone lets PostgreSQL's generic plan for a prepared statement walk the primary
# key from the bound and filter out every later message of every other session (tens of ms once other
# sessions wrote 100k messages after an old boundary); this order makes the index the obvious plan.
OLDEST_FIRST = (messages.c.session_id, messages.c.deleted, messages.c.message_id)
NEWEST_FIRST = (messages.c.session_id.desc(), messages.c.deleted.desc(), messages.c.message_id.desc())


# What a page needs to decide which messages travel whole: everything but the body, plus small
# bodies (cheap, and the source of their previews when they travel as stubs).
LIGHT = (
    messages.c.message_id,
    messages.c.session_id,
    messages.c.role,
    messages.c.tool_call_id,
    messages.c.status,
    messages.c.deleted,
    messages.c.create_ms,
    messages.c.body_bytes,
    messages.c.preview,
    messages.c.result_truncated,
    case((messages.c.body_bytes <= bodies.STORED_PREVIEW_BYTES, messages.c.content), else_=null()).label("content"),
)


# Whole rows for backends' pages: every column, the content (nearly all of a page's bytes) as its JSON
# text, parsed here by orjson, which reads large tool outputs over twice as fast as the driver's
# json.loads. The column holds JSON-shaped values only, as written (see persistence._json).
WHOLE = (
    *(column for column in messages.c if column.name != "content"),
    cast(messages.c.content, Text).label("content"),
)


async def list_after(
    connection: AsyncConnection, owner: str, session_id: str, after_message_id: int, limit: int, max_bytes: int
) -> tuple[list[dict[str, Any]], bool]:
    """Live messages with id > after_message_id, ascending and whole: at most `limit`, and no more
    than `max_bytes` of bodies (but at least one). Returns them and whether more follow.

    Sizes are read first, so no body beyond the page is ever loaded. Served by (session_id, deleted, id).
    """
    await sessions.load(connection, owner, session_id)
    live = (
        (messages.c.session_id == session_id)
        & messages.c.deleted.is_(False)
        & (messages.c.message_id > after_message_id)
    )
    sizes = (
        await connection.execute(
            select(messages.c.message_id, messages.c.body_bytes).where(live).order_by(*OLDEST_FIRST).limit(limit + 1)
        )
    ).all()
    if not sizes:
        return [], False
    kept, total = 0, 0
    for _, body_bytes in sizes[:limit]:
        if kept and total + body_bytes > max_bytes:
            break
        kept, total = kept + 1, total + body_bytes
    last = sizes[kept - 1][0]
    rows = await connection.execute(select(*WHOLE).where(live, messages.c.message_id <= last).order_by(*OLDEST_FIRST))
    return [{**row, "content": orjson.loads(row["content"])} for row in rows.mappings()], len(sizes) > kept


async def page(
    connection: AsyncConnection,
    owner: str,
    session_id: str,
    anchor: int,
    newer: bool,
    size: int,
    seq_pin: int | None = None,
) -> tuple[list[RowMapping], bool, bool]:
    """Up to `size` live messages on one side of `anchor` (0 = the end), ascending and light (see
    `LIGHT`; `bounded` decides which travel whole), with whether more exist beyond each edge of the
    page; with `seq_pin`, only messages committed by then."""
    await sessions.load(connection, owner, session_id)
    live = (messages.c.session_id == session_id) & messages.c.deleted.is_(False)
    if seq_pin is not None:
        live = live & (messages.c.commit_seq <= seq_pin)
    if newer:
        query = select(*LIGHT).where(live, messages.c.message_id > anchor).order_by(*OLDEST_FIRST)
    else:
        bound = messages.c.message_id < anchor if anchor else messages.c.message_id.is_not(None)
        query = select(*LIGHT).where(live, bound).order_by(*NEWEST_FIRST)
    rows = list((await connection.execute(query.limit(size + 1))).mappings())
    more = len(rows) > size
    rows = rows[:size]
    if not newer:
        rows.reverse()
    if newer:
        has_older = anchor > 0 and await _exists(connection, live & (messages.c.message_id <= anchor))
        return rows, has_older, more
    has_newer = anchor > 0 and await _exists(connection, live & (messages.c.message_id >= anchor))
    return rows, more, has_newer


async def bounded(
    connection: AsyncConnection, light: Sequence[RowMapping], limits: bodies.Limits, *, newest_first: bool
) -> list[pb.Message]:
    """Light rows (ascending) as messages for a page or frame: whole while they fit `limits`, in
    order of preference (the newest first, or the oldest first), stubs for the rest. Only the
    bodies that travel are read."""
    preferred = reversed(light) if newest_first else light
    whole = bodies.inline_ids([(row["message_id"], row["body_bytes"]) for row in preferred], limits)
    full: dict[int, RowMapping] = {}
    if whole:
        found = await connection.execute(select(messages).where(messages.c.message_id.in_(sorted(whole))))
        full = {row["message_id"]: row for row in found.mappings()}
    rows = [full.get(row["message_id"]) or bodies.stub_row(row) for row in light]
    return await with_media_types(connection, rows)


async def _exists(connection: AsyncConnection, condition: ColumnElement[bool]) -> bool:
    found = await connection.execute(select(messages.c.message_id).where(condition).limit(1))
    return found.first() is not None


async def edit_user_message(
    connection: AsyncConnection,
    owner: str,
    session_id: str,
    message_id: int,
    content: list[dict[str, object]],
    body_bytes: int,
    expected_generation: int | None,
    now_ms: int,
) -> tuple[dict[str, Any], int, int, int]:
    """Replace a USER message's content and logically delete every later message, atomically.

    Refused, changing nothing, when the message is at or below the compaction fence (checked by
    the same statement that bumps the generation, so SetCompactionFence cannot slip in between).
    Returns the edited message, the new history generation, how many messages were deleted, and
    the HISTORY_REWRITTEN event id.
    """
    session = await sessions.load(connection, owner, session_id)
    generation = await sessions.bump_generation(connection, session_id, expected_generation, message_id, now_ms)
    if generation is None:
        await _explain_refused_edit(connection, owner, session_id, message_id, expected_generation)
        # Nothing explains it any more: the fence moved back down meanwhile. Rare; the caller retries.
        raise HistoryGenerationMismatch("the session changed while editing; retry", metadata={"session_id": session_id})
    target = await _find(connection, session_id, message_id)
    _check_editable(target, session_id)
    body = {"content": content, "body_bytes": body_bytes, "preview": bodies.stored_preview(content, body_bytes)}
    await connection.execute(update(messages).where(messages.c.message_id == message_id).values(**body))
    removed = await connection.execute(
        update(messages)
        .where(
            messages.c.session_id == session_id,
            messages.c.deleted.is_(False),
            messages.c.message_id > message_id,
        )
        .values(deleted=True)
    )
    event_id = await events.record(
        connection,
        event_type=events.HISTORY_REWRITTEN,
        session=session,
        payload={"edited_message_id": message_id, "history_generation": generation},
        now_ms=now_ms,
    )
    return {**target, **body}, generation, int(removed.rowcount), event_id


def _check_editable(target: Mapping[Any, Any], session_id: str) -> None:
    if target["deleted"] or target["role"] != pb.MESSAGE_ROLE_USER:
        raise MessageNotEditable(
            "only a live USER message can be edited",
            metadata={"session_id": session_id, "message_id": target["message_id"]},
        )


async def _explain_refused_edit(
    connection: AsyncConnection, owner: str, session_id: str, message_id: int, expected_generation: int | None
) -> None:
    """Raise the reason the generation bump did not match, read after it (fresh on PostgreSQL,
    under the writer lock on SQLite). Returns only when nothing explains it any more."""
    current = await sessions.load(connection, owner, session_id)
    _check_editable(await _find(connection, session_id, message_id), session_id)
    fence = int(current["compaction_fence_message_id"])
    if message_id <= fence:
        raise MessageAlreadyCompacted(
            f"message {message_id} is already covered by the session summary and can no longer be edited",
            metadata={"session_id": session_id, "message_id": message_id, "compaction_fence_message_id": fence},
        )
    if expected_generation is not None and current["history_generation"] != expected_generation:
        raise HistoryGenerationMismatch(
            "the history changed since the caller read it",
            metadata={"session_id": session_id, "expected_generation": expected_generation},
        )
