"""The derived turn index behind GetHistoryOutline: one row per turn, rebuildable at any time.

A turn is one live USER message (the prompt) plus every live message after it until the next
USER message, numbered 1.. in message-id order. Messages before the first prompt belong to no
turn. The index is disposable: `INDEX_VERSION` names the shape of its rows, and an index built
by another version is dropped and rebuilt from the unchanged messages.

The index covers every message with `commit_seq <= coverage_seq`. Message ids and commit
sequences grow together (the publisher hands out both in order), so the messages committed
after the coverage are a suffix in id order and only the last turn can grow into them.

Reading stays cheap on purpose: previews need the text of prompts and final answers, so content
is only selected for USER messages and assistant messages without tool calls. Tool results
(often megabytes), the reasoning around tool calls and tool call arguments are never fetched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from sqlalchemy import (
    JSON,
    ColumnElement,
    Row,
    Text,
    case,
    cast,
    delete,
    func,
    insert,
    literal_column,
    null,
    select,
    update,
)
from sqlalchemy.ext.asyncio import AsyncConnection

from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum_runtime.clock import Clock
from continuum_runtime.database import Database, insert_ignoring_conflicts
from continuum_transcript.bodies import STORED_PREVIEW_BYTES, preview
from continuum_transcript.tables import messages, session_runtime, turn_index_state, turns

# Bump whenever what a turn row holds or how it is derived changes: every index built by an
# older version is then rebuilt on its next read. 2: every tool call counts, not every distinct id.
INDEX_VERSION = 2

# Messages read per query and turn rows written per statement: huge sessions stay bounded.
CHUNK_ROWS = 2000
INSERT_ROWS = 500
# Sessions per page when rebuilding every session.
SESSION_PAGE = 500

# The version of a state row created only to be locked; no real index has it.
_UNBUILT = 0
_ASSISTANT = messages.c.role == pb.MESSAGE_ROLE_ASSISTANT
# Messages whose text a preview may need: prompts, and assistant messages without tool calls
# (the only candidates for the final answer). Both writers store an empty list as "[]", and
# PostgreSQL's json keeps the text as written; reasoning around tool calls is never fetched.
_BODIES = (messages.c.role == pb.MESSAGE_ROLE_USER) | (
    _ASSISTANT & cast(messages.c.tool_calls, Text).in_(("[]", "null"))
)
# The ids of an assistant message's tool calls, extracted by the database: tool call arguments
# can hold whole files, and the count needs only the ids.
_CALL_IDS = {
    "postgresql": (
        "CASE WHEN json_typeof(messages.tool_calls) = 'array' THEN (SELECT json_agg(element.value ->> 'tool_call_id')"
        " FROM json_array_elements(messages.tool_calls) AS element) END"
    ),
    "sqlite": (
        "(SELECT json_group_array(json_extract(element.value, '$.tool_call_id'))"
        " FROM json_each(messages.tool_calls) AS element WHERE element.type = 'object')"
    ),
}

# A fetched row of any width, its columns read by name.
_Row: TypeAlias = Row[*tuple[Any, ...]]


@dataclass(frozen=True)
class _State:
    version: int
    coverage_seq: int


@dataclass
class _Turn:
    """One turn being built: the prompt's facts plus what its later messages add."""

    turn: int
    prompt_message_id: int
    position: int
    prompt_preview: str
    started_ms: int
    commit_seq: int
    answer_preview: str | None = None
    final_message_id: int | None = None
    finished_ms: int | None = None
    # messageKey -> highest attempt seen, and how many tool calls recorded assistant messages issued.
    attempts: dict[str, int] = field(default_factory=dict)
    tool_calls: int = 0

    def add(self, row: _Row) -> None:
        """Fold one later message of the turn in. Its content is None unless it was read: only an
        assistant message without tool calls, committed after the coverage, can be the answer."""
        if row.role != pb.MESSAGE_ROLE_ASSISTANT:
            return
        record = _attempt_record(row.metadata)
        if record is not None:
            key, attempt = record
            self.attempts[key] = max(attempt, self.attempts.get(key, 0))
            # Every call counts: ids are not unique (some servers number each response's calls from
            # call_0, so every tool round reuses them), and compaction's model view pairs a result
            # with one call of its id, never merging two calls that share it.
            self.tool_calls += len(_strings(row.call_ids))
        # An assistant message without text (an empty or attachment-only reply) is no answer.
        answer = _text_preview(row)
        if answer:
            self.answer_preview = answer
            self.final_message_id = int(row.message_id)
            self.finished_ms = int(row.create_ms)

    def values(self, session_id: str) -> dict[str, Any]:
        """The turn's row. Counts only come from backend records: imported history has none,
        and guessing them from message shapes would be wrong, so they stay NULL."""
        recorded = bool(self.attempts)
        return {
            "session_id": session_id,
            "turn": self.turn,
            "prompt_message_id": self.prompt_message_id,
            "position": self.position,
            "prompt_preview": self.prompt_preview,
            "answer_preview": self.answer_preview,
            "final_message_id": self.final_message_id,
            "started_ms": self.started_ms,
            "finished_ms": self.finished_ms,
            "sampling_count": sum(self.attempts.values()) if recorded else None,
            "tool_call_count": self.tool_calls if recorded else None,
            "commit_seq": self.commit_seq,
        }


async def refresh(connection: AsyncConnection, session_id: str, durable_seq: int, now_ms: int) -> int:
    """Bring the session's index up to `durable_seq` (at `now_ms`) and return the sequence it covers.

    Writes the index, so call it inside a transaction that commits. An index of another
    version (or none) is rebuilt from every live message; otherwise only the messages committed
    after the coverage are read, plus the metadata of the last turn, which they may extend.
    """
    state = await _state(connection, session_id, lock=False)
    if state is not None and state.version == INDEX_VERSION and state.coverage_seq >= durable_seq:
        return state.coverage_seq
    # Concurrent refreshers of one session would insert the same turn rows: they queue on the
    # state row, and a missing row is created first so that there is something to lock.
    await connection.execute(
        insert_ignoring_conflicts(connection, turn_index_state)
        .values(session_id=session_id, version=_UNBUILT, coverage_seq=0, update_ms=now_ms)
        .on_conflict_do_nothing()
    )
    state = await _state(connection, session_id, lock=True)
    if state is None:  # pragma: no cover - the row was inserted or locked just above
        raise RuntimeError("turn index state vanished inside its transaction")
    if state.version == INDEX_VERSION and state.coverage_seq >= durable_seq:
        # Another refresher got there while this one waited for the lock.
        return state.coverage_seq
    if state.version != INDEX_VERSION or not await _extend(connection, session_id, state.coverage_seq, durable_seq):
        await _build(connection, session_id, durable_seq)
    await connection.execute(
        update(turn_index_state)
        .where(turn_index_state.c.session_id == session_id)
        .values(version=INDEX_VERSION, coverage_seq=durable_seq, update_ms=now_ms)
    )
    return durable_seq


async def invalidate(connection: AsyncConnection, session_id: str) -> None:
    """Drop the session's index; the next read rebuilds it. A history rewrite calls this inside
    its own transaction, so no reader ever sees turns of the old history after the rewrite."""
    # The state row first: refreshers lock it before touching turns, and the same order here
    # keeps the two from deadlocking.
    await connection.execute(delete(turn_index_state).where(turn_index_state.c.session_id == session_id))
    await connection.execute(delete(turns).where(turns.c.session_id == session_id))


async def outline(
    connection: AsyncConnection,
    session_id: str,
    *,
    start_turn: int,
    limit: int,
    stream_generation_pin: int | None,
    seq_pin: int | None,
    current_stream_generation: int,
    durable_seq: int,
    now_ms: int,
) -> api.GetHistoryOutlineResponse:
    """One page of the session's outline, from turn `start_turn`, at most `limit` turns.

    `start_turn` and `limit` must already be validated (one-based, positive). A first page
    passes no pins and gets the cut it was served at (`stream_generation`, `snapshot_sequence`);
    later pages pass that cut back, so turns committed since never shift or extend them. A pin
    of another stream generation (a rewrite happened) answers STALE without entries. Refreshes the
    index, so call it inside a transaction that commits.
    """
    if stream_generation_pin and stream_generation_pin != current_stream_generation:
        return api.GetHistoryOutlineResponse(status=api.PIN_STATUS_STALE, stream_generation=current_stream_generation)
    coverage = await refresh(connection, session_id, durable_seq, now_ms)
    snapshot = seq_pin if seq_pin else coverage
    visible = (turns.c.session_id == session_id) & (turns.c.commit_seq <= snapshot)
    total = await connection.scalar(select(func.count()).select_from(turns).where(visible))
    # One row beyond the page tells whether more turns follow.
    found = (
        await connection.execute(
            select(turns).where(visible, turns.c.turn >= start_turn).order_by(turns.c.turn).limit(limit + 1)
        )
    ).all()
    page = found[:limit]
    return api.GetHistoryOutlineResponse(
        status=api.PIN_STATUS_OK,
        stream_generation=current_stream_generation,
        snapshot_sequence=snapshot,
        coverage_sequence=coverage,
        total_turns=int(total or 0),
        entries=[_entry(row) for row in page],
        next_turn=int(page[-1].turn) + 1 if page else start_turn,
        done=len(found) <= limit,
    )


async def rebuild(database: Database, clock: Clock, session_id: str | None = None) -> int:
    """Rebuild the index of one session, or of every session that has messages, from scratch.

    Each session is rebuilt in its own transaction, so a large installation never holds one
    long transaction. Returns how many sessions were rebuilt.
    """
    if session_id is not None:
        return int(await _rebuild_one(database, clock, session_id))
    rebuilt = 0
    after = ""
    while True:
        async with database.connection() as connection:
            page = list(
                (
                    await connection.execute(
                        select(messages.c.session_id)
                        .where(messages.c.session_id > after)
                        .group_by(messages.c.session_id)
                        .order_by(messages.c.session_id)
                        .limit(SESSION_PAGE)
                    )
                ).scalars()
            )
        for found in page:
            rebuilt += int(await _rebuild_one(database, clock, found))
        if len(page) < SESSION_PAGE:
            return rebuilt
        after = page[-1]


async def _rebuild_one(database: Database, clock: Clock, session_id: str) -> bool:
    async with database.transaction() as connection:
        await invalidate(connection, session_id)
        runtime_seq = await connection.scalar(
            select(session_runtime.c.durable_seq).where(session_runtime.c.session_id == session_id)
        )
        stored = (
            await connection.execute(
                select(func.count(), func.coalesce(func.max(messages.c.commit_seq), 0)).where(
                    messages.c.session_id == session_id
                )
            )
        ).one()
        if not stored[0]:
            return False
        # Sessions older than the live publisher have no runtime row: their messages decide.
        await refresh(connection, session_id, max(int(runtime_seq or 0), int(stored[1])), clock.now_ms())
    return True


async def _state(connection: AsyncConnection, session_id: str, *, lock: bool) -> _State | None:
    query = select(turn_index_state.c.version, turn_index_state.c.coverage_seq).where(
        turn_index_state.c.session_id == session_id
    )
    if lock:
        query = query.with_for_update()
    row = (await connection.execute(query)).first()
    return None if row is None else _State(int(row.version), int(row.coverage_seq))


async def _build(connection: AsyncConnection, session_id: str, durable_seq: int) -> None:
    """Every turn from the first live message on."""
    await connection.execute(delete(turns).where(turns.c.session_id == session_id))
    await _scan(
        connection,
        session_id,
        current=None,
        next_turn=1,
        position=0,
        after_id=0,
        rows=messages.c.commit_seq <= durable_seq,
        bodies=_BODIES,
    )


async def _extend(connection: AsyncConnection, session_id: str, coverage_seq: int, durable_seq: int) -> bool:
    """Add what was committed after `coverage_seq`; False when the index no longer matches
    the messages (its last prompt is gone) and must be rebuilt instead."""
    last = (
        await connection.execute(
            select(turns).where(turns.c.session_id == session_id).order_by(turns.c.turn.desc()).limit(1)
        )
    ).first()
    new = (messages.c.commit_seq > coverage_seq) & (messages.c.commit_seq <= durable_seq)
    if last is None:
        # No prompt yet: everything covered so far precedes the first turn and only counts.
        before = await connection.scalar(
            select(func.count()).where(
                messages.c.session_id == session_id,
                messages.c.deleted.is_(False),
                messages.c.commit_seq <= coverage_seq,
            )
        )
        await _scan(
            connection,
            session_id,
            current=None,
            next_turn=1,
            position=int(before or 0),
            after_id=0,
            rows=new,
            bodies=_BODIES,
        )
        return True
    prompt_live = await connection.scalar(
        select(messages.c.message_id).where(
            messages.c.message_id == last.prompt_message_id,
            messages.c.session_id == session_id,
            messages.c.deleted.is_(False),
        )
    )
    if prompt_live is None:
        return False
    # The last turn is read again from its prompt for its attempt records (a retry may settle a
    # messageKey seen before), but the covered part's previews are kept, not re-read.
    await connection.execute(delete(turns).where(turns.c.session_id == session_id, turns.c.turn == last.turn))
    current = _Turn(
        turn=int(last.turn),
        prompt_message_id=int(last.prompt_message_id),
        position=int(last.position),
        prompt_preview=str(last.prompt_preview),
        started_ms=int(last.started_ms),
        commit_seq=int(last.commit_seq),
        answer_preview=last.answer_preview,
        final_message_id=None if last.final_message_id is None else int(last.final_message_id),
        finished_ms=None if last.finished_ms is None else int(last.finished_ms),
    )
    await _scan(
        connection,
        session_id,
        current=current,
        next_turn=current.turn + 1,
        position=current.position,
        after_id=current.prompt_message_id - 1,
        rows=messages.c.commit_seq <= durable_seq,
        bodies=_BODIES & new,
    )
    return True


async def _scan(
    connection: AsyncConnection,
    session_id: str,
    *,
    current: _Turn | None,
    next_turn: int,
    position: int,
    after_id: int,
    rows: ColumnElement[bool],
    bodies: ColumnElement[bool],
) -> None:
    """Read live messages after `after_id` matching `rows` in id order, a chunk at a time, and
    write the turns they form. `current` is a turn continued from the index (its prompt is the
    first row read); `position` counts the live messages before the first row read. Content is
    only selected for rows matching `bodies`."""
    # A preview never reads a large body: its preview was stored with it (see bodies.py).
    small = messages.c.body_bytes <= STORED_PREVIEW_BYTES
    content = case((bodies & small, messages.c.content), else_=null()).label("content")
    stored = case((bodies & ~small, messages.c.preview), else_=null()).label("stored_preview")
    call_ids = case((_ASSISTANT, literal_column(_CALL_IDS[connection.dialect.name], JSON)), else_=null()).label(
        "call_ids"
    )
    query = select(
        messages.c.message_id,
        messages.c.role,
        call_ids,
        case((_ASSISTANT, messages.c.metadata), else_=null()).label("metadata"),
        messages.c.create_ms,
        messages.c.commit_seq,
        content,
        stored,
    ).where(messages.c.session_id == session_id, messages.c.deleted.is_(False), rows)
    pending: list[dict[str, Any]] = []
    while True:
        chunk = (
            await connection.execute(
                query.where(messages.c.message_id > after_id).order_by(messages.c.message_id).limit(CHUNK_ROWS)
            )
        ).all()
        for row in chunk:
            continued = current is not None and row.message_id == current.prompt_message_id
            if row.role == pb.MESSAGE_ROLE_USER and not continued:
                if current is not None:
                    pending.append(current.values(session_id))
                current = _Turn(
                    turn=next_turn,
                    prompt_message_id=int(row.message_id),
                    position=position,
                    prompt_preview=_text_preview(row) or "",
                    started_ms=int(row.create_ms),
                    commit_seq=int(row.commit_seq),
                )
                next_turn += 1
            elif current is not None and not continued:
                current.add(row)
            position += 1
        if len(pending) >= INSERT_ROWS or len(chunk) < CHUNK_ROWS:
            await _write(connection, pending)
            pending = []
        if len(chunk) < CHUNK_ROWS:
            break
        after_id = int(chunk[-1].message_id)
    if current is not None:
        await _write(connection, [current.values(session_id)])


async def _write(connection: AsyncConnection, rows: list[dict[str, Any]]) -> None:
    if rows:
        await connection.execute(insert(turns), rows)


def _entry(row: _Row) -> api.OutlineEntry:
    entry = api.OutlineEntry(
        message_id=int(row.prompt_message_id),
        turn=int(row.turn),
        position=int(row.position),
        prompt=str(row.prompt_preview),
        final_message_id=int(row.final_message_id or 0),
    )
    if row.answer_preview is not None:
        entry.answer = str(row.answer_preview)
    if row.finished_ms is not None:
        entry.elapsed.FromMilliseconds(max(0, int(row.finished_ms) - int(row.started_ms)))
    if row.sampling_count is not None:
        entry.sampling_count = int(row.sampling_count)
    if row.tool_call_count is not None:
        entry.tool_call_count = int(row.tool_call_count)
    return entry


def _text_preview(row: _Row) -> str | None:
    """The preview of a row whose text was read (its small body, or the preview stored with a large
    one); None for a row whose text was not read."""
    if row.stored_preview is not None:
        return str(row.stored_preview)
    if row.content is not None:
        return preview(row.content)
    return None


def _strings(values: Any) -> Sequence[str]:
    if not isinstance(values, list):
        return []
    return [value for value in values if isinstance(value, str) and value]


def _attempt_record(metadata: Any) -> tuple[str, int] | None:
    """The live publisher's sampling record on an assistant message, if it has one."""
    if not isinstance(metadata, dict):
        return None
    key, attempt = metadata.get("messageKey"), metadata.get("attempt")
    if not isinstance(key, str) or not key or not isinstance(attempt, int) or isinstance(attempt, bool):
        return None
    return (key, attempt) if attempt > 0 else None
