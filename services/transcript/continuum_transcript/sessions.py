"""Session store: create (idempotent by id), read, list, update and delete a subtree."""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import RowMapping, and_, literal, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from continuum_runtime.database import insert_ignoring_conflicts
from continuum_transcript import events
from continuum_transcript.errors import SessionAlreadyExists, SessionNotFound, SessionPermissionDenied
from continuum_transcript.tables import sessions

UPDATABLE_FIELDS = ("title", "model", "working_directory", "memory_injection_disabled", "metadata")


@dataclass(frozen=True)
class NewSession:
    """Validated parameters of a session to create."""

    session_id: str | None
    parent_session_id: str | None
    kind: int
    title: str
    model: str
    working_directory: str
    memory_injection_disabled: bool
    metadata: dict[str, Any]

    def fingerprint(self, owner: str) -> str:
        """Identifies the parameters, so a retried create can be told from a conflicting one."""
        fields = {**self.__dict__, "session_id": None, "owner": owner}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


async def load(
    connection: AsyncConnection, owner: str, session_id: str, *, include_deleted: bool = False
) -> RowMapping:
    """The session row; PERMISSION_DENIED for another owner's session (checked before NOT_FOUND)."""
    row = (await connection.execute(select(sessions).where(sessions.c.session_id == session_id))).mappings().first()
    if row is not None and row["owner"] != owner:
        raise SessionPermissionDenied("the session belongs to another user", metadata={"session_id": session_id})
    if row is None or (row["deleted"] and not include_deleted):
        raise SessionNotFound("no such session", metadata={"session_id": session_id})
    return row


async def create(connection: AsyncConnection, owner: str, new: NewSession, now_ms: int) -> tuple[RowMapping, bool]:
    """Insert the session (created at `now_ms`), or return the identical one created earlier with the same id."""
    root_id: str | None = None
    if new.parent_session_id is not None:
        parent = await load(connection, owner, new.parent_session_id)
        root_id = parent["root_session_id"]
    session_id = new.session_id or uuid.uuid4().hex
    fingerprint = new.fingerprint(owner)
    values = {
        "session_id": session_id,
        "owner": owner,
        "parent_session_id": new.parent_session_id,
        "root_session_id": root_id or session_id,
        "kind": new.kind,
        "title": new.title,
        "model": new.model,
        "working_directory": new.working_directory,
        "memory_injection_disabled": new.memory_injection_disabled,
        "metadata": new.metadata,
        "create_fingerprint": fingerprint,
        "history_generation": 1,
        "compaction_fence_message_id": 0,
        "deleted": False,
        "create_ms": now_ms,
        "update_ms": now_ms,
    }
    # Racing creates with the same id: exactly one insert wins, the others compare fingerprints.
    statement = insert_ignoring_conflicts(connection, sessions).values(values).on_conflict_do_nothing()
    inserted = (await connection.execute(statement)).rowcount == 1
    row = (await connection.execute(select(sessions).where(sessions.c.session_id == session_id))).mappings().one()
    if not inserted and row["owner"] == owner and row["deleted"]:
        # Only the owner learns that the id was theirs: to anyone else it is just taken.
        raise SessionAlreadyExists(
            "a deleted session of yours had this id, and session ids are never used again",
            metadata={"session_id": session_id},
        )
    if not inserted and (row["owner"] != owner or row["create_fingerprint"] != fingerprint):
        raise SessionAlreadyExists("a different session already has this id", metadata={"session_id": session_id})
    return row, inserted


async def list_page(
    connection: AsyncConnection, owner: str, parent_session_id: str | None, limit: int, after: tuple[int, str] | None
) -> list[RowMapping]:
    """Live sessions of `owner`, newest first, after the (create_ms, session_id) cursor."""
    query = select(sessions).where(sessions.c.owner == owner, sessions.c.deleted.is_(False))
    if parent_session_id is not None:
        query = query.where(sessions.c.parent_session_id == parent_session_id)
    if after is not None:
        created, last_id = after
        query = query.where(
            or_(
                sessions.c.create_ms < created,
                and_(sessions.c.create_ms == created, sessions.c.session_id < last_id),
            )
        )
    query = query.order_by(sessions.c.create_ms.desc(), sessions.c.session_id.desc()).limit(limit)
    return list((await connection.execute(query)).mappings())


async def update_fields(
    connection: AsyncConnection, owner: str, session_id: str, changes: dict[str, Any], now_ms: int
) -> RowMapping:
    """Apply `changes` (a subset of UPDATABLE_FIELDS) to a live session."""
    current = await load(connection, owner, session_id)
    if not changes:
        return current
    result = await connection.execute(
        update(sessions)
        .where(sessions.c.session_id == session_id)
        .values(**changes, update_ms=now_ms)
        .returning(*sessions.c)
    )
    return result.mappings().one()


async def delete_tree(connection: AsyncConnection, owner: str, session_id: str, now_ms: int) -> tuple[list[str], int]:
    """Logically delete the session and every live descendant; write one DELETED event."""
    row = await load(connection, owner, session_id, include_deleted=True)
    if row["deleted"]:
        return [], 0
    tree = select(sessions.c.session_id).where(sessions.c.session_id == session_id).cte("tree", recursive=True)
    tree = tree.union_all(select(sessions.c.session_id).where(sessions.c.parent_session_id == tree.c.session_id))
    found = await connection.execute(
        select(sessions.c.session_id)
        .where(sessions.c.session_id.in_(select(tree.c.session_id)), sessions.c.deleted.is_(False))
        .order_by(sessions.c.session_id)
    )
    deleted_ids = list(found.scalars())
    await connection.execute(
        update(sessions)
        .where(sessions.c.session_id.in_(deleted_ids), sessions.c.deleted.is_(False))
        .values(deleted=True, delete_ms=now_ms, update_ms=now_ms)
    )
    event_id = await events.record(
        connection,
        event_type=events.DELETED,
        session=row,
        payload={"deleted_session_ids": deleted_ids},
        now_ms=now_ms,
    )
    return deleted_ids, event_id


async def bump_generation(
    connection: AsyncConnection, session_id: str, expected: int | None, edited_message_id: int, now_ms: int
) -> int | None:
    """Advance the history generation for an edit of `edited_message_id`; None when refused.

    One conditional UPDATE decides, by whether it matched the row: the compaction fence must lie
    below the edited message and, when `expected` is given, the generation must still be it. The
    UPDATE takes the session row lock, which SetCompactionFence takes too; on PostgreSQL a change
    that commits while this statement waits is re-checked against the condition (READ COMMITTED
    re-evaluates the WHERE on the newest row version), so a fence that commits first refuses the
    edit, and an edit that commits first makes the fence's generation check fail.
    """
    condition = and_(sessions.c.session_id == session_id, sessions.c.compaction_fence_message_id < edited_message_id)
    if expected is not None:
        condition = and_(condition, sessions.c.history_generation == expected)
    result = await connection.execute(
        update(sessions)
        .where(condition)
        .values(history_generation=sessions.c.history_generation + literal(1), update_ms=now_ms)
        .returning(sessions.c.history_generation)
    )
    generation = result.scalar_one_or_none()
    return None if generation is None else int(generation)
