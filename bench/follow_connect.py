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

The large case: a session of more than 200 MiB (ten 15 MB tool results among 100,000 small messages)
is connected to the same way; its p50 against the 1k session's is `large_ratio` (same target), and
the transcript process's peak resident memory while serving those connects is
`transcript_peak_rss_mib` (target: under 300 MiB). Either missing its target fails the run.
"""

from __future__ import annotations

import asyncio
import functools
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

from bench.bench_support import (
    MESSAGE_COLUMNS,
    BenchDatabase,
    SyntheticMessage,
    TranscriptClient,
    big_vs_small,
    copy_messages,
    emit_result,
    explain,
    interleaved_rows,
    log,
    noise_sessions,
    parse_args,
    sample_rotating,
    throwaway_database,
    transcript_server,
)
from continuum.transcript.v1 import follow_pb2 as fpb
from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum_runtime.process_memory import peak_rss_bytes, reset_peak_rss
from continuum_runtime.wire_names import TRANSCRIPT_V2
from continuum_transcript.follow import SNAPSHOT_PAGE
from continuum_transcript.messages import LIGHT, NEWEST_FIRST
from continuum_transcript.tables import messages

BIG_MESSAGES = 100_000
SMALL_MESSAGES = 1_000
# The large session: HUGE_MESSAGES tool results of HUGE_BYTES among BIG_MESSAGES small messages.
HUGE_MESSAGES = 10
HUGE_BYTES = 15 * 1024 * 1024
PEAK_RSS_TARGET_MIB = 300
# Messages per committed batch: each batch has its own commit_seq.
BATCH = 50
WARMUP_CALLS = 30
SAMPLES = 300
TARGET_RATIO = 1.5
CAPABILITY = TRANSCRIPT_V2


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


def with_commit_seq(rows: Iterator[tuple[Any, ...]]) -> Iterator[tuple[Any, ...]]:
    """MESSAGE_COLUMNS rows + their commit_seq: each session's messages committed BATCH at a time."""
    written: dict[str, int] = {}
    for row in rows:
        session_id = row[0]
        number = written.get(session_id, 0)
        written[session_id] = number + 1
        yield (*row, number // BATCH + 1)


async def explain_case(database: BenchDatabase, case: Case) -> None:
    """Print the plan of the snapshot page read (mirrors follow.read_page_at) for diagnosis."""
    query = (
        select(*LIGHT)
        .where(
            messages.c.session_id == case.session_id,
            messages.c.deleted.is_(False),
            messages.c.commit_seq <= case.seq,
        )
        .order_by(*NEWEST_FIRST)
        .limit(SNAPSHOT_PAGE + 1)
    )
    await explain(database, query, f"plan of the {case.label} snapshot page:")


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
    calls = {case.label: functools.partial(connect, client, case) for case in (big, small)}
    log(f"warming up ({WARMUP_CALLS} connects per case; the first binds the publisher) ...")
    for number in range(WARMUP_CALLS):
        for label, warm_up in calls.items():
            elapsed = await warm_up()
            if number == 0:
                log(f"  first Follow of the {label} session (binds its publisher): {elapsed:.1f} ms")
    log(f"measuring {SAMPLES} connects per case, alternating ...")
    return await sample_rotating(calls, SAMPLES)


def with_huge_results(rows: Iterator[tuple[Any, ...]], session_id: str, every: int) -> Iterator[tuple[Any, ...]]:
    """`rows`, with every `every`-th row of `session_id` replaced by a HUGE_BYTES tool result."""
    seen = 0
    for row in rows:
        if row[0] == session_id:
            seen += 1
            if seen % every == 0:
                text = f"log {seen} " + "L" * HUGE_BYTES
                huge = SyntheticMessage(pb.MESSAGE_ROLE_TOOL, text, [], "read-log", {})
                row = huge.columns(session_id, row[8])
        yield row


async def measure_large(client: TranscriptClient, large: Case, small: Case) -> dict[str, Any]:
    """Connects to the large session against the 1k one, and the server's peak memory meanwhile."""
    calls = {case.label: functools.partial(connect, client, case) for case in (large, small)}
    await calls[large.label]()  # binds the publisher
    reset_peak_rss(client.server_pid)
    samples = await sample_rotating(calls, SAMPLES // 3)
    peak_mib = peak_rss_bytes(client.server_pid) / (1024 * 1024)
    log(f"transcript peak RSS while following the large session: {peak_mib:.0f} MiB")
    fields = big_vs_small(samples, large.label, small.label)
    return {
        "p50_large_ms": fields["p50_large_ms"],
        "p95_large_ms": fields["p95_large_ms"],
        "large_ratio": round(fields["value"] / fields["baseline"], 3),
        "transcript_peak_rss_mib": round(peak_mib, 1),
    }


async def run(admin_url: str, seed: int) -> dict[str, Any]:
    """The whole benchmark in its own database; returns the result fields."""
    rng = random.Random(seed)
    async with throwaway_database(admin_url) as database, transcript_server(database) as client:
        big = Case("100k", await client.create_session("bench-big", "100k messages"), BIG_MESSAGES)
        small = Case("1k", await client.create_session("bench-small", "1k messages"), SMALL_MESSAGES)
        large = Case("large", await client.create_session("bench-large", "over 200 MiB"), BIG_MESSAGES)
        sizes = {big.session_id: big.messages, small.session_id: small.messages, **await noise_sessions(client)}
        sizes[large.session_id] = large.messages
        rows = with_huge_results(interleaved_rows(rng, sizes), large.session_id, BIG_MESSAGES // HUGE_MESSAGES)
        await copy_messages(database, sizes, with_commit_seq(rows), [*MESSAGE_COLUMNS, "commit_seq"])
        samples = await measure(client, big, small)
        await explain_case(database, big)
        await explain_case(database, small)
        large_fields = await measure_large(client, large, small)
        history_mib = await large_history_mib(database, large.session_id)
    return {
        **big_vs_small(samples, big.label, small.label),
        **large_fields,
        "large_history_mib": history_mib,
        "samples_per_case": SAMPLES,
        "snapshot_page": SNAPSHOT_PAGE,
        "messages_per_commit_seq": BATCH,
        "total_messages": sum(sizes.values()),
    }


async def large_history_mib(database: BenchDatabase, session_id: str) -> float:
    """The stored size of the large session's bodies."""
    connection = await asyncpg.connect(database.raw_url, server_settings={"search_path": "transcript"})
    try:
        total = await connection.fetchval("SELECT sum(body_bytes) FROM messages WHERE session_id = $1", session_id)
    finally:
        await connection.close()
    return round(int(total) / (1024 * 1024), 1)


def main() -> None:
    """Run, then print the JSON result as the last line (after the database is dropped)."""
    args = parse_args((__doc__ or "").splitlines()[0])
    result = asyncio.run(run(args.database_url, args.seed))
    large_met = result["large_ratio"] <= TARGET_RATIO and result["transcript_peak_rss_mib"] < PEAK_RSS_TARGET_MIB
    emit_result(
        metric="follow_connect_to_snapshot_end_p50_100k_vs_1k",
        target=TARGET_RATIO,
        unit="ms",
        higher_is_better=False,
        valid=large_met,
        peak_rss_target_mib=PEAK_RSS_TARGET_MIB,
        **result,
    )


if __name__ == "__main__":
    main()
