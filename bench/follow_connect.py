"""Benchmark: Follow connect time must not grow with the session's length (100k vs 1k messages).

A follower that connects without a resume cursor gets a fresh baseline: handshake, snapshot begin,
the last page of records at the cut, runtime state, snapshot end. Only the last page is read, so
reaching `snapshot_end` must cost the same on a 100,000-message session as on a 1,000-message
one. Both sessions live in one database, interleaved with other sessions' messages and bulk-loaded
with COPY as the publisher would have stored them (one `commit_seq` per batch of 50 messages; the
publisher binds on the first Follow and resumes `durable_seq` from the largest `commit_seq`).
Connect time is measured through the real gRPC server, from the call's start to `snapshot_end`,
alternating the two sessions.

    .venv/bin/python bench/follow_connect.py [--database-url postgresql://postgres@host:5432/postgres]

Result: value = p50 connect time (ms) on the 100k session, baseline = p50 on the 1k session,
ratio = value / baseline, target: ratio <= 1.5 (p95 reported too).
"""

from __future__ import annotations

import asyncio
import math
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
from continuum.transcript.v1 import follow_pb2 as fpb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum_transcript.follow import SNAPSHOT_PAGE
from continuum_transcript.tables import messages

BIG_MESSAGES = 100_000
SMALL_MESSAGES = 1_000
# Other sessions interleaved with the two measured ones, so a session's ids are not contiguous.
NOISE_SESSIONS = 6
NOISE_MESSAGES = 2_000
TURN = 4  # messages of one agent turn, written together
# Messages per committed batch: each batch has its own commit_seq.
BATCH = 50
WARMUP_CALLS = 30
SAMPLES = 300
TARGET_RATIO = 1.5
CAPABILITY = "transcript-v2"


@dataclass(frozen=True)
class Case:
    """One measured session."""

    label: str
    session_id: str
    messages: int

    @property
    def seq(self) -> int:
        """The largest commit_seq of the session: where the publisher resumes."""
        return math.ceil(self.messages / BATCH)


def turn_schedule(rng: random.Random, sizes: dict[str, int]) -> list[str]:
    """Session ids in write order, a turn at a time, shuffled so sessions interleave."""
    turns = [session_id for session_id, count in sizes.items() for _ in range(count // TURN)]
    rng.shuffle(turns)
    return turns


def rows(rng: random.Random, schedule: list[str]) -> Iterator[tuple[Any, ...]]:
    """Rows for COPY (MESSAGE_COLUMNS + commit_seq), generated lazily."""
    generators: dict[str, ConversationGenerator] = {}
    written: dict[str, int] = {}
    start_ms = int(time.time() * 1000) - len(schedule) * TURN * 1000
    for index, session_id in enumerate(schedule):
        generator = generators.setdefault(session_id, ConversationGenerator(rng, 200, 2000))
        for offset in range(TURN):
            number = written.get(session_id, 0)
            written[session_id] = number + 1
            columns = generator.next().columns(session_id, start_ms + (index * TURN + offset) * 1000)
            yield (*columns, number // BATCH + 1)


async def load(database: BenchDatabase, rng: random.Random, sizes: dict[str, int]) -> None:
    """Bulk-load every session's messages with COPY, then ANALYZE so the planner sees real sizes."""
    schedule = turn_schedule(rng, sizes)
    total = len(schedule) * TURN
    log(f"loading {total:,} messages over {len(sizes)} sessions with COPY ...")
    started = time.perf_counter()
    connection = await asyncpg.connect(database.raw_url)
    try:
        await connection.copy_records_to_table(
            "messages",
            schema_name=SCHEMA,
            columns=[*MESSAGE_COLUMNS, "commit_seq"],
            records=rows(rng, schedule),
        )
        log(f"loaded {total:,} messages in {time.perf_counter() - started:.1f}s; ANALYZE ...")
        await connection.execute(f"ANALYZE {SCHEMA}.messages")
        size = await connection.fetchval(f"SELECT pg_size_pretty(pg_total_relation_size('{SCHEMA}.messages'))")
        log(f"messages table with indexes and TOAST: {size}")
    finally:
        await connection.close()


async def explain(database: BenchDatabase, case: Case) -> None:
    """Print the plan of the snapshot page read (mirrors follow.read_page_at) for diagnosis."""
    query = (
        select(messages)
        .where(
            messages.c.session_id == case.session_id,
            messages.c.deleted.is_(False),
            messages.c.commit_seq <= case.seq,
        )
        .order_by(messages.c.message_id.desc())
        .limit(SNAPSHOT_PAGE + 1)
    )
    # An engine that never connects, only for its dialect: the SQL exactly as the service renders it.
    dialect = create_async_engine(database.service_url).dialect
    sql = str(query.compile(dialect=dialect, compile_kwargs={"literal_binds": True}))
    connection = await asyncpg.connect(database.raw_url, server_settings={"search_path": SCHEMA})
    try:
        plan = await connection.fetch(f"EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF) {sql}")
    finally:
        await connection.close()
    log(f"plan of the {case.label} snapshot page:")
    for line in plan:
        log(f"    {line[0]}")


async def connect(client: TranscriptClient, case: Case) -> float:
    """One Follow from the call's start to snapshot_end, in milliseconds; checks the baseline."""
    request = api.FollowRequest(session_id=case.session_id, capabilities=[CAPABILITY])
    started = time.perf_counter()
    call = client.stub.Follow(request, metadata=client.metadata)
    elapsed = 0.0
    records = 0
    try:
        async for frame in call:
            kind = frame.WhichOneof("frame")
            if kind == "handshake" and frame.handshake.mode != fpb.FOLLOW_MODE_BASELINE:
                raise AssertionError(f"{case.label}: expected a fresh baseline, got {frame.handshake}")
            if kind == "snapshot_begin" and frame.snapshot_begin.seq != case.seq:
                raise AssertionError(f"{case.label}: snapshot at seq {frame.snapshot_begin.seq}, expected {case.seq}")
            if kind == "snapshot_records":
                records = len(frame.snapshot_records.messages)
                if not frame.snapshot_records.has_older:
                    raise AssertionError(f"{case.label}: the snapshot page should have older messages")
            if kind == "snapshot_end":
                elapsed = (time.perf_counter() - started) * 1000
                break
    finally:
        call.cancel()
    if not elapsed or records != SNAPSHOT_PAGE:
        raise AssertionError(f"{case.label}: no complete snapshot ({records} records)")
    return elapsed


async def measure(client: TranscriptClient, big: Case, small: Case) -> dict[str, list[float]]:
    """Warm up both cases (the first Follow binds each publisher), then SAMPLES connects each,
    alternating which goes first to cancel drift."""
    log(f"warming up ({WARMUP_CALLS} connects per case; the first binds the publisher) ...")
    for number in range(WARMUP_CALLS):
        for case in (big, small):
            elapsed = await connect(client, case)
            if number == 0:
                log(f"  first Follow of the {case.label} session (binds its publisher): {elapsed:.1f} ms")
    samples: dict[str, list[float]] = {big.label: [], small.label: []}
    log(f"measuring {SAMPLES} connects per case, alternating ...")
    for index in range(SAMPLES):
        order = (big, small) if index % 2 == 0 else (small, big)
        for case in order:
            samples[case.label].append(await connect(client, case))
        if (index + 1) % 100 == 0:
            log(
                f"  {index + 1}/{SAMPLES}: p50 100k {percentile(samples[big.label], 0.5):.2f} ms,"
                f" 1k {percentile(samples[small.label], 0.5):.2f} ms"
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
        "snapshot_page": SNAPSHOT_PAGE,
        "messages_per_commit_seq": BATCH,
        "total_messages": sum(sizes.values()),
    }


def main() -> None:
    """Run, then print the JSON result as the last line (after the database is dropped)."""
    args = parse_args((__doc__ or "").splitlines()[0])
    result = asyncio.run(run(args.database_url, args.seed))
    emit_result(
        metric="follow_connect_to_snapshot_end_p50_100k_vs_1k",
        target=TARGET_RATIO,
        unit="ms",
        higher_is_better=False,
        **result,
    )


if __name__ == "__main__":
    main()
