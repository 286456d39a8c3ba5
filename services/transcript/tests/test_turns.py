"""The derived turn index: splitting, previews, counts from records, incremental refresh equal to a
rebuild, invalidation on rewrite, pinned outline pages, and the operator's rebuild command."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from clock_testing import ManualClock
from google.protobuf import json_format
from sqlalchemy import insert, select, text, update
from sqlalchemy.exc import DBAPIError

from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum_runtime import migrations
from continuum_runtime.database import Database
from continuum_transcript import bodies, turns
from continuum_transcript.server import MIGRATIONS_DIR, open_database
from continuum_transcript.settings import TranscriptSettings
from continuum_transcript.tables import messages, session_runtime, turn_index_state
from continuum_transcript.tables import turns as turn_rows

USER, ASSISTANT, TOOL, SYSTEM = (
    pb.MESSAGE_ROLE_USER,
    pb.MESSAGE_ROLE_ASSISTANT,
    pb.MESSAGE_ROLE_TOOL,
    pb.MESSAGE_ROLE_SYSTEM,
)
# Valid JSON to PostgreSQL and to SQLite, but Python's decoder gives up on the nesting: any
# statement that fetches this content fails, so it proves the content is never selected.
# Rows stored with it: tool results, and assistant messages issuing tool calls (their text is
# reasoning, never a preview).
POISON = "[" * 5000 + "]" * 5000


@pytest.fixture
async def database(database_url: str) -> AsyncIterator[Database]:
    """A migrated transcript database on each backend."""
    db = Database(database_url, schema="transcript")
    await migrations.upgrade(db, MIGRATIONS_DIR)
    try:
        yield db
    finally:
        await db.dispose()


def user(text_: str) -> dict[str, Any]:
    """A USER message row."""
    return {"role": USER, "content": [{"text": text_}]}


def assistant(text_: str, *calls: str, key: str | None = None, attempt: int = 1) -> dict[str, Any]:
    """An ASSISTANT message row; with `key`, it carries the live publisher's attempt record."""
    return {
        "role": ASSISTANT,
        "content": [{"text": text_}] if text_ else [],
        "tool_calls": [{"tool_call_id": c, "name": "shell", "arguments": "{}"} for c in calls],
        "metadata": {"messageKey": key, "attempt": attempt} if key else {},
    }


def tool(call: str, text_: str = "ok") -> dict[str, Any]:
    """A TOOL result row."""
    return {"role": TOOL, "content": [{"text": text_}], "tool_call_id": call}


def system(text_: str) -> dict[str, Any]:
    """A SYSTEM message row."""
    return {"role": SYSTEM, "content": [{"text": text_}]}


class Session:
    """Writes message rows the way the publisher commits them: one business batch per sequence."""

    def __init__(self, database: Database, session_id: str = "s1") -> None:
        self.database = database
        self.session_id = session_id
        self.seq = 0
        self.clock = 1_000
        self.stream_generation = 1

    async def commit(self, *rows: dict[str, Any], poison: bool = False) -> list[int]:
        """Insert `rows` as the next batch and advance the durable sequence; returns their ids."""
        self.seq += 1
        ids: list[int] = []
        async with self.database.transaction() as connection:
            for row in rows:
                self.clock += 100
                values = {
                    "session_id": self.session_id,
                    "role": row["role"],
                    "content": row["content"],
                    "tool_calls": row.get("tool_calls", []),
                    "tool_call_id": row.get("tool_call_id", ""),
                    "metadata": row.get("metadata", {}),
                    "status": pb.MESSAGE_STATUS_COMPLETE,
                    "deleted": False,
                    "create_ms": self.clock,
                    "commit_seq": self.seq,
                }
                if poison and (row["role"] == TOOL or row.get("tool_calls")):
                    ids.append(await _insert_poisoned(connection, values))
                    continue
                found = await connection.execute(insert(messages).values(values).returning(messages.c.message_id))
                ids.append(int(found.scalar_one()))
            runtime = {"stream_generation": self.stream_generation, "durable_seq": self.seq, "update_ms": self.clock}
            changed = await connection.execute(
                update(session_runtime).where(session_runtime.c.session_id == self.session_id).values(runtime)
            )
            if changed.rowcount == 0:
                await connection.execute(
                    insert(session_runtime).values(
                        session_id=self.session_id, runtime_state={}, pending_prompts={}, **runtime
                    )
                )
        return ids

    async def refresh(self) -> int:
        """Bring the index up to the durable sequence."""
        async with self.database.transaction() as connection:
            return await turns.refresh(connection, self.session_id, self.seq, self.clock)

    async def outline(
        self, start_turn: int = 1, limit: int = 128, stream_generation: int = 0, seq: int = 0
    ) -> api.GetHistoryOutlineResponse:
        """One outline page as the servicer would ask for it."""
        async with self.database.transaction() as connection:
            return await turns.outline(
                connection,
                self.session_id,
                start_turn=start_turn,
                limit=limit,
                stream_generation_pin=stream_generation,
                seq_pin=seq,
                current_stream_generation=self.stream_generation,
                durable_seq=self.seq,
                now_ms=self.clock,
            )

    async def rows(self) -> list[dict[str, Any]]:
        """The stored turn rows, in order."""
        async with self.database.connection() as connection:
            found = await connection.execute(
                select(turn_rows).where(turn_rows.c.session_id == self.session_id).order_by(turn_rows.c.turn)
            )
            return [dict(row) for row in found.mappings()]

    async def rebuilt_rows(self) -> list[dict[str, Any]]:
        """What a from-scratch rebuild stores (the index is left rebuilt)."""
        async with self.database.transaction() as connection:
            await turns.invalidate(connection, self.session_id)
            await turns.refresh(connection, self.session_id, self.seq, self.clock)
        return await self.rows()


async def _insert_poisoned(connection: Any, values: dict[str, Any]) -> int:
    # Raw SQL: the JSON type would serialize the poison as a harmless JSON string.
    found = await connection.execute(
        text(
            "INSERT INTO messages (session_id, role, content, tool_calls, tool_call_id, metadata, status, deleted,"
            " create_ms, commit_seq) VALUES (:session_id, :role, :content, :tool_calls, :tool_call_id, :metadata,"
            " :status, :deleted, :create_ms, :commit_seq) RETURNING message_id"
        ),
        {
            **values,
            "content": POISON,
            "tool_calls": json.dumps(values["tool_calls"]),
            "metadata": json.dumps(values["metadata"]),
        },
    )
    return int(found.scalar_one())


def _turns(response: api.GetHistoryOutlineResponse) -> list[int]:
    return [entry.turn for entry in response.entries]


async def test_turns_split_at_prompts_with_positions_previews_and_final_answers(database: Database) -> None:
    log = Session(database)
    ids = await log.commit(
        system("you are helpful"),
        user("  run   the\n\n tests\t please "),
        assistant("let me look", "c1"),
        tool("c1"),
        assistant("first thoughts"),
        assistant("", "c2"),
        tool("c2"),
        assistant("all   green"),
        assistant("checking once more", "c3"),
        tool("c3"),
        user("x" * 150 + "      " + "y" * 150),
        assistant("on it", "c4"),
        tool("c4"),
        user("third"),
        assistant(""),
    )
    outline = await log.outline()
    assert outline.status == api.PIN_STATUS_OK
    assert (outline.total_turns, outline.done, outline.next_turn) == (3, True, 4)
    assert outline.coverage_sequence == outline.snapshot_sequence == 1
    first, second, third = outline.entries
    assert (first.turn, first.message_id, first.position, first.prompt) == (1, ids[1], 1, "run the tests please")
    # The last assistant message with text and no tool calls answers, even before later tool work.
    assert (first.answer, first.final_message_id) == ("all green", ids[7])
    assert first.elapsed.ToMilliseconds() == 600
    assert (second.turn, second.message_id, second.position) == (2, ids[10], 10)
    assert len(second.prompt) <= bodies.PREVIEW_CHARS and second.prompt.endswith("…")
    assert second.prompt.startswith("x" * 150 + " y")
    assert not second.HasField("answer") and second.final_message_id == 0 and second.elapsed.ToMilliseconds() == 0
    # An empty assistant reply is no answer.
    assert (third.turn, third.position, third.prompt, third.HasField("answer")) == (3, 13, "third", False)
    # Imported history has no sampling records: no counts are invented.
    for entry in outline.entries:
        assert not entry.HasField("sampling_count") and not entry.HasField("tool_call_count")


async def test_counts_come_from_attempt_records_with_retries_and_every_call(database: Database) -> None:
    log = Session(database)
    await log.commit(user("retry once"))
    await log.commit(assistant("partial", key="k1", attempt=1))
    await log.commit(assistant("the answer", key="k1", attempt=2))
    await log.commit(
        user("use tools"),
        assistant("calling", "c1", "c2", key="k2"),
        tool("c1"),
        tool("c2"),
        # An answered call's id issued again is another call; a call without a record is not counted.
        assistant("again", "c2", "c3", key="k3", attempt=3),
        assistant("unrecorded", "c9"),
        tool("c3"),
        assistant("done", key="k4"),
    )
    retried, tools = (await log.outline()).entries
    assert (retried.sampling_count, retried.tool_call_count, retried.answer) == (2, 0, "the answer")
    assert (tools.sampling_count, tools.tool_call_count, tools.answer) == (1 + 3 + 1, 4, "done")


async def test_every_tool_call_counts_even_when_servers_reuse_its_id(database: Database) -> None:
    # Some OpenAI-compatible servers number calls per response: every turn, and every tool round of a
    # turn, issues `call_0` again. An id names a call only until it is answered, so it never merges two.
    log = Session(database)
    for number in range(3):
        await log.commit(
            user(f"turn {number}"),
            assistant("calling", "call_0", key=f"t{number}"),
            tool("call_0"),
            assistant(f"done {number}", key=f"a{number}"),
        )
    await log.commit(user("rounds"), assistant("round 1", "call_0", "call_1", key="r1"), tool("call_1"))
    await log.refresh()
    # Round 2's result is stored before the assistant that issued it; round 3 reuses the id again.
    await log.commit(tool("call_0"), tool("call_0"), assistant("round 2", "call_0", key="r2"))
    await log.refresh()
    await log.commit(assistant("round 3", "call_0", key="r3"), tool("call_0"), assistant("done", key="r4"))
    entries = (await log.outline()).entries
    assert [(entry.sampling_count, entry.tool_call_count) for entry in entries] == [(2, 1), (2, 1), (2, 1), (4, 4)]
    assert await log.rows() == await log.rebuilt_rows()


@pytest.mark.parametrize("chunk", [2, 2000])
async def test_incremental_refresh_equals_a_full_rebuild(
    database: Database, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    monkeypatch.setattr(turns, "CHUNK_ROWS", chunk)
    monkeypatch.setattr(turns, "INSERT_ROWS", 1)
    builds = 0
    build = turns._build

    async def counting_build(*args: Any, **kwargs: Any) -> None:
        nonlocal builds
        builds += 1
        await build(*args, **kwargs)

    monkeypatch.setattr(turns, "_build", counting_build)
    log = Session(database)
    batches: list[tuple[dict[str, Any], ...]] = [
        (system("preamble"),),
        (system("more preamble"), user("first")),
        (assistant("thinking", "c1", key="k1"), tool("c1")),
        (assistant("partial", key="k2", attempt=1),),
        # A retry of an attempt seen before the coverage must not be counted twice.
        (assistant("answer one", key="k2", attempt=2), user("second"), assistant("", "c2", key="k3")),
        (tool("c2"), assistant("answer two", key="k4")),
        (user("third"), assistant("imported, no record")),
        (user("fourth"),),
    ]
    for batch in batches:
        await log.commit(*batch)
        assert await log.refresh() == log.seq
    assert builds == 1
    incremental = await log.rows()
    assert [row["turn"] for row in incremental] == [1, 2, 3, 4]
    assert [row["commit_seq"] for row in incremental] == [2, 5, 7, 8]
    assert incremental == await log.rebuilt_rows()
    assert (incremental[0]["sampling_count"], incremental[0]["tool_call_count"]) == (3, 1)
    assert incremental[0]["answer_preview"] == "answer one"
    assert incremental[2]["sampling_count"] is None


async def test_deleted_messages_belong_to_no_turn_and_take_no_position(database: Database) -> None:
    log = Session(database)
    ids = await log.commit(user("kept"), assistant("gone"), user("gone too"), assistant("kept answer"), user("last"))
    async with database.transaction() as connection:
        await connection.execute(
            update(messages).where(messages.c.message_id.in_([ids[1], ids[2]])).values(deleted=True)
        )
    first, last = (await log.outline()).entries
    assert (first.message_id, first.answer, first.final_message_id) == (ids[0], "kept answer", ids[3])
    assert (last.turn, last.message_id, last.position) == (2, ids[4], 2)


async def test_a_rewrite_invalidates_and_the_next_read_rebuilds(database: Database) -> None:
    log = Session(database)
    ids = await log.commit(user("one"), assistant("a1"), user("two"), assistant("a2"), user("three"))
    before = await log.outline()
    assert before.total_turns == 3
    # What EditUserMessage does: edit, delete everything later, bump the history generation, invalidate.
    async with database.transaction() as connection:
        await connection.execute(
            update(messages).where(messages.c.message_id == ids[2]).values(content=[{"text": "two, edited"}])
        )
        await connection.execute(update(messages).where(messages.c.message_id > ids[2]).values(deleted=True))
        await connection.execute(update(session_runtime).values(stream_generation=2))
        await turns.invalidate(connection, log.session_id)
        assert await connection.scalar(select(turn_index_state.c.version)) is None
    log.stream_generation = 2
    stale = await log.outline(start_turn=2, stream_generation=before.stream_generation, seq=before.snapshot_sequence)
    assert (stale.status, stale.stream_generation, list(stale.entries)) == (api.PIN_STATUS_STALE, 2, [])
    await log.commit(assistant("a2, again"))
    after = await log.outline()
    assert (after.status, after.stream_generation, after.total_turns) == (api.PIN_STATUS_OK, 2, 2)
    assert [(e.prompt, e.answer) for e in after.entries] == [("one", "a1"), ("two, edited", "a2, again")]


async def test_outline_pages_and_pinned_pages_ignore_later_turns(database: Database) -> None:
    log = Session(database)
    for number in range(1, 6):
        await log.commit(user(f"prompt {number}"), assistant(f"answer {number}"))
    first = await log.outline(limit=2)
    assert (_turns(first), first.next_turn, first.done, first.total_turns) == ([1, 2], 3, False, 5)
    pin = {"stream_generation": first.stream_generation, "seq": first.snapshot_sequence}
    # Turns committed after the first page must not shift or extend the pinned listing.
    await log.commit(user("prompt 6"), assistant("answer 6"))
    second = await log.outline(start_turn=first.next_turn, limit=2, **pin)
    assert (_turns(second), second.next_turn, second.done, second.total_turns) == ([3, 4], 5, False, 5)
    assert second.snapshot_sequence == first.snapshot_sequence and second.coverage_sequence == log.seq
    third = await log.outline(start_turn=second.next_turn, limit=2, **pin)
    assert (_turns(third), third.next_turn, third.done, third.total_turns) == ([5], 6, True, 5)
    beyond = await log.outline(start_turn=9, limit=2, **pin)
    assert (_turns(beyond), beyond.next_turn, beyond.done) == ([], 9, True)
    fresh = await log.outline(start_turn=5, limit=2)
    assert (_turns(fresh), fresh.done, fresh.total_turns, fresh.snapshot_sequence) == ([5, 6], True, 6, log.seq)


async def test_a_stale_generation_pin_answers_stale_without_entries(database: Database) -> None:
    log = Session(database)
    await log.commit(user("hello"), assistant("hi"))
    log.stream_generation = 3
    stale = await log.outline(stream_generation=2, seq=1)
    assert (stale.status, stale.stream_generation, len(stale.entries), stale.total_turns) == (
        api.PIN_STATUS_STALE,
        3,
        0,
        0,
    )


async def test_an_empty_session_has_an_empty_done_outline(database: Database) -> None:
    log = Session(database)
    empty = await log.outline()
    assert (empty.status, empty.total_turns, empty.done, empty.next_turn) == (api.PIN_STATUS_OK, 0, True, 1)
    encoded = json_format.MessageToDict(empty, always_print_fields_with_no_presence=True)
    assert encoded["entries"] == []
    await log.commit(system("only a preamble"))
    assert json_format.MessageToDict(await log.outline(), always_print_fields_with_no_presence=True)["entries"] == []


async def test_a_new_index_version_forces_a_rebuild(database: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    log = Session(database)
    await log.commit(user("hello"), assistant("hi"))
    await log.refresh()
    async with database.transaction() as connection:
        await connection.execute(update(turn_rows).values(prompt_preview="built by an older version"))
    # Same version, nothing new: the index is trusted as it is.
    assert (await log.outline()).entries[0].prompt == "built by an older version"
    monkeypatch.setattr(turns, "INDEX_VERSION", turns.INDEX_VERSION + 1)
    assert (await log.outline()).entries[0].prompt == "hello"
    async with database.connection() as connection:
        assert await connection.scalar(select(turn_index_state.c.version)) == turns.INDEX_VERSION


async def test_tool_results_and_tool_call_reasoning_are_never_read(database: Database) -> None:
    log = Session(database)
    await log.commit(user("list files"), assistant("reasoning", "c1", key="k1"), tool("c1"), poison=True)
    # The poison really breaks any statement that fetches it.
    async with database.connection() as connection:
        for role in (TOOL, ASSISTANT):
            with pytest.raises((RecursionError, DBAPIError)):
                (await connection.execute(select(messages.c.content).where(messages.c.role == role))).all()
    await log.refresh()
    # The incremental refresh reads the last turn again from its prompt, over the poisoned rows.
    await log.commit(assistant("more", "c2", "c1", key="k2"), tool("c2"), assistant("here", key="k3"), poison=True)
    (entry,) = (await log.outline()).entries
    assert (entry.answer, entry.sampling_count, entry.tool_call_count) == ("here", 3, 3)
    assert await log.rows() == await log.rebuilt_rows()


async def test_concurrent_first_reads_build_the_index_once(database: Database) -> None:
    log = Session(database)
    for number in range(1, 4):
        await log.commit(user(f"prompt {number}"), assistant(f"answer {number}"))
    # Each read refreshes in its own transaction; they queue on the state row instead of
    # inserting the same turns twice.
    outlines = await asyncio.gather(*[log.outline() for _ in range(6)])
    assert {(o.total_turns, tuple(_turns(o)), o.coverage_sequence) for o in outlines} == {(3, (1, 2, 3), 3)}
    # Extending an existing index races the same way.
    await log.commit(assistant("answer 3, revised"), user("prompt 4"), assistant("answer 4"))
    outlines = await asyncio.gather(*[log.outline() for _ in range(6)])
    assert {(o.total_turns, o.entries[2].answer, o.coverage_sequence) for o in outlines} == {
        (4, "answer 3, revised", 4)
    }
    assert await log.rows() == await log.rebuilt_rows()


async def test_rebuild_covers_every_session_with_messages(database: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(turns, "SESSION_PAGE", 1)
    one, two = Session(database, "one"), Session(database, "two")
    await one.commit(user("a"), assistant("b"))
    await two.commit(system("preamble only"))
    await one.refresh()
    async with database.transaction() as connection:
        await connection.execute(update(turn_rows).values(prompt_preview="corrupt"))
    assert await turns.rebuild(database, ManualClock()) == 2
    assert [row["prompt_preview"] for row in await one.rows()] == ["a"]
    assert await turns.rebuild(database, ManualClock(), "two") == 1
    assert await turns.rebuild(database, ManualClock(), "nobody") == 0
    async with database.connection() as connection:
        states = (
            await connection.execute(select(turn_index_state.c.session_id, turn_index_state.c.coverage_seq))
        ).all()
    assert sorted(states) == [("one", 1), ("two", 1)]


async def test_rebuild_command_prints_how_many_sessions_it_rebuilt(tmp_path: Path) -> None:
    settings = TranscriptSettings(data_dir=tmp_path / "data")
    database = open_database(settings)
    try:
        await migrations.upgrade(database, MIGRATIONS_DIR)
        for session_id in ("a", "b", "c"):
            await Session(database, session_id).commit(user(f"prompt of {session_id}"), assistant("answer"))
    finally:
        await database.dispose()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSCRIPT_")}
    env["TRANSCRIPT_DATA_DIR"] = str(settings.data_dir)

    async def run(*arguments: str) -> tuple[int, str]:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "continuum_transcript",
            "rebuild-turn-index",
            *arguments,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        out, _ = await process.communicate()
        return int(process.returncode or 0), out.decode()

    code, out = await run()
    assert code == 0 and re.fullmatch(r"rebuilt the turn index of 3 session\(s\)\n", out), out
    code, out = await run("--session", "b")
    assert code == 0 and "of 1 session" in out and "prompt" not in out
    database = open_database(settings)
    try:
        async with database.connection() as connection:
            previews = (
                await connection.execute(select(turn_rows.c.prompt_preview).order_by(turn_rows.c.session_id))
            ).scalars()
            assert list(previews) == ["prompt of a", "prompt of b", "prompt of c"]
    finally:
        await database.dispose()
