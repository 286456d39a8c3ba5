"""Benchmark: `ListMessagesAfter` near the end of a long session must not slow down with its length.

A client resuming a session asks for the messages after the last boundary it knows, which is
almost always near the end. That read must cost the same on a 100,000-message session as on a
1,000-message one: the (session_id, deleted, message_id) index should start the scan at the
boundary. Both sessions live in one database, interleaved with other sessions' messages, and the
call is measured through the real gRPC server.

    .venv/bin/python bench/history_after.py [--database-url postgresql://postgres@host:5432/postgres]

Result: value = p50 latency (ms) on the 100k session, baseline = p50 on the 1k session,
ratio = value / baseline, target: ratio <= 1.5.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Run as `python bench/<name>.py`: the repo root must be importable for `bench.bench_support`
# (a package path, so that mypy resolves it the same way as the interpreter does).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import asyncpg
from sqlalchemy import select
from sqlalchemy.ext.asyncio import create_async_engine

from bench.bench_support import (
    MESSAGE_COLUMNS,
    SCHEMA,
    BenchDatabase,
    ConversationGenerator,
    TranscriptClient,
    emit_result,
    log,
    parse_args,
    percentile,
    throwaway_database,
    transcript_server,
)
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum_transcript.tables import messages

BIG_MESSAGES = 100_000
SMALL_MESSAGES = 1_000
# Other users' sessions interleaved with the two measured ones, so ids of a session are not
# contiguous and the table is bigger than the sessions we read (as in production).
NOISE_SESSIONS = 6
NOISE_MESSAGES = 2_000
TAIL = 50
TURN = 4  # messages of one agent turn, written together
WARMUP_CALLS = 40
SAMPLES = 300
TARGET_RATIO = 1.5


@dataclass(frozen=True)
class Case:
    """One measured session and the boundary that leaves exactly TAIL messages after it."""

    label: str
    session_id: str
    messages: int
    after_message_id: int = 0


def turn_schedule(rng: random.Random, sizes: dict[str, int]) -> list[str]:
    """Session ids in write order, a turn at a time, shuffled so sessions interleave."""
    turns = [session_id for session_id, count in sizes.items() for _ in range(count // TURN)]
    rng.shuffle(turns)
    return turns


def rows(rng: random.Random, schedule: list[str]) -> Iterator[tuple[Any, ...]]:
    """Rows for COPY, generated lazily (~150 MB of text never sits in memory at once)."""
    generators: dict[str, ConversationGenerator] = {}
    start_ms = int(time.time() * 1000) - len(schedule) * TURN * 1000
    for index, session_id in enumerate(schedule):
        generator = generators.setdefault(session_id, ConversationGenerator(rng, 200, 2000))
        for offset in range(TURN):
            yield generator.next().columns(session_id, start_ms + (index * TURN + offset) * 1000)


async def load(database: BenchDatabase, rng: random.Random, sizes: dict[str, int]) -> None:
    """Bulk-load every session's messages with COPY, then ANALYZE so the planner sees real sizes."""
    schedule = turn_schedule(rng, sizes)
    total = len(schedule) * TURN
    log(f"loading {total:,} messages over {len(sizes)} sessions with COPY ...")
    started = time.perf_counter()
    connection = await asyncpg.connect(database.raw_url)
    try:
        await connection.copy_records_to_table(
            "messages", schema_name=SCHEMA, columns=list(MESSAGE_COLUMNS), records=rows(rng, schedule)
        )
        log(f"loaded {total:,} messages in {time.perf_counter() - started:.1f}s; ANALYZE ...")
        await connection.execute(f"ANALYZE {SCHEMA}.messages")
        size = await connection.fetchval(f"SELECT pg_size_pretty(pg_total_relation_size('{SCHEMA}.messages'))")
        log(f"messages table with indexes and TOAST: {size}")
    finally:
        await connection.close()


async def boundary(database: BenchDatabase, case: Case) -> Case:
    """The id after which exactly TAIL live messages of the session remain."""
    connection = await asyncpg.connect(database.raw_url)
    try:
        after = await connection.fetchval(
            f"SELECT message_id FROM {SCHEMA}.messages WHERE session_id = $1 AND NOT deleted"
            " ORDER BY message_id DESC OFFSET $2 LIMIT 1",
            case.session_id,
            TAIL,
        )
    finally:
        await connection.close()
    return Case(case.label, case.session_id, case.messages, int(after))


async def explain(database: BenchDatabase, case: Case) -> None:
    """Print the plan of the statement the service runs (mirrors messages.list_after) for diagnosis."""
    query = (
        select(messages)
        .where(
            messages.c.session_id == case.session_id,
            messages.c.deleted.is_(False),
            messages.c.message_id > case.after_message_id,
        )
        .order_by(messages.c.message_id)
        .limit(501)
    )
    # An engine that never connects, only for its dialect: the SQL exactly as the service renders it.
    dialect = create_async_engine(database.service_url).dialect
    sql = str(query.compile(dialect=dialect, compile_kwargs={"literal_binds": True}))
    connection = await asyncpg.connect(database.raw_url, server_settings={"search_path": SCHEMA})
    try:
        plan = await connection.fetch(f"EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF) {sql}")
    finally:
        await connection.close()
    log(f"plan of the {case.label} case:")
    for line in plan:
        log(f"    {line[0]}")


async def call(client: TranscriptClient, case: Case) -> float:
    """One ListMessagesAfter round trip in milliseconds; checks it returned exactly the tail."""
    started = time.perf_counter()
    response: api.ListMessagesAfterResponse = await client.stub.ListMessagesAfter(
        api.ListMessagesAfterRequest(session_id=case.session_id, after_message_id=case.after_message_id),
        metadata=client.metadata,
    )
    elapsed = (time.perf_counter() - started) * 1000
    if len(response.messages) != TAIL or response.next_page_token:
        raise AssertionError(f"{case.label}: expected {TAIL} messages, got {len(response.messages)}")
    return elapsed


async def measure(client: TranscriptClient, big: Case, small: Case) -> dict[str, list[float]]:
    """Warm up both cases, then SAMPLES calls each, alternating which goes first to cancel drift."""
    log(f"warming up ({WARMUP_CALLS} calls per case) ...")
    for _ in range(WARMUP_CALLS):
        await call(client, big)
        await call(client, small)
    samples: dict[str, list[float]] = {big.label: [], small.label: []}
    log(f"measuring {SAMPLES} calls per case, alternating ...")
    for index in range(SAMPLES):
        order = (big, small) if index % 2 == 0 else (small, big)
        for case in order:
            samples[case.label].append(await call(client, case))
        if (index + 1) % 100 == 0:
            log(
                f"  {index + 1}/{SAMPLES}: p50 big {percentile(samples[big.label], 0.5):.2f} ms,"
                f" small {percentile(samples[small.label], 0.5):.2f} ms"
            )
    return samples


async def run(admin_url: str, seed: int) -> dict[str, Any]:
    """The whole benchmark in its own database; returns the result fields."""
    rng = random.Random(seed)
    async with throwaway_database(admin_url) as database, transcript_server(database) as client:
        big = Case("100k", await client.create_session("bench-big", "100k messages"), BIG_MESSAGES)
        small = Case("1k", await client.create_session("bench-small", "1k messages"), SMALL_MESSAGES)
        sizes = {big.session_id: big.messages, small.session_id: small.messages}
        for number in range(NOISE_SESSIONS):
            noise = await client.create_session(f"bench-noise-{number}", "other traffic")
            sizes[noise] = NOISE_MESSAGES
        await load(database, rng, sizes)
        big, small = await boundary(database, big), await boundary(database, small)
        log(f"boundaries: 100k after id {big.after_message_id}, 1k after id {small.after_message_id}")
        samples = await measure(client, big, small)
        await explain(database, big)
        await explain(database, small)
    big_ms, small_ms = samples[big.label], samples[small.label]
    for label, values in samples.items():
        log(f"{label}: p50 {percentile(values, 0.5):.2f} ms, p95 {percentile(values, 0.95):.2f} ms")
    return {
        "value": percentile(big_ms, 0.5),
        "baseline": percentile(small_ms, 0.5),
        "p50_100k_ms": round(percentile(big_ms, 0.5), 3),
        "p95_100k_ms": round(percentile(big_ms, 0.95), 3),
        "p50_1k_ms": round(percentile(small_ms, 0.5), 3),
        "p95_1k_ms": round(percentile(small_ms, 0.95), 3),
        "ratio_p95": round(percentile(big_ms, 0.95) / percentile(small_ms, 0.95), 3),
        "samples_per_case": SAMPLES,
        "tail_messages": TAIL,
        "total_messages": sum(sizes.values()),
    }


def main() -> None:
    """Run, then print the JSON result as the last line (after the database is dropped)."""
    args = parse_args((__doc__ or "").splitlines()[0])
    result = asyncio.run(run(args.database_url, args.seed))
    emit_result(
        metric="list_messages_after_tail_p50_latency_100k_vs_1k",
        target=TARGET_RATIO,
        unit="ms",
        higher_is_better=False,
        **result,
    )


if __name__ == "__main__":
    main()
