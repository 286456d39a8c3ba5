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
import functools
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Run as `python bench/<name>.py`: the repo root must be importable for `bench.bench_support`
# (a package path, so that mypy resolves it the same way as the interpreter does).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import asyncpg
from sqlalchemy import select

from bench.bench_support import (
    SCHEMA,
    BenchDatabase,
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
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum_transcript.tables import messages

BIG_MESSAGES = 100_000
SMALL_MESSAGES = 1_000
TAIL = 50
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


async def explain_case(database: BenchDatabase, case: Case) -> None:
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
    await explain(database, query, f"plan of the {case.label} case:")


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
    calls = {case.label: functools.partial(call, client, case) for case in (big, small)}
    log(f"warming up ({WARMUP_CALLS} calls per case) ...")
    for _ in range(WARMUP_CALLS):
        for warm_up in calls.values():
            await warm_up()
    log(f"measuring {SAMPLES} calls per case, alternating ...")
    return await sample_rotating(calls, SAMPLES)


async def run(admin_url: str, seed: int) -> dict[str, Any]:
    """The whole benchmark in its own database; returns the result fields."""
    rng = random.Random(seed)
    async with throwaway_database(admin_url) as database, transcript_server(database) as client:
        big = Case("100k", await client.create_session("bench-big", "100k messages"), BIG_MESSAGES)
        small = Case("1k", await client.create_session("bench-small", "1k messages"), SMALL_MESSAGES)
        sizes = {big.session_id: big.messages, small.session_id: small.messages, **await noise_sessions(client)}
        await copy_messages(database, sizes, interleaved_rows(rng, sizes))
        big, small = await boundary(database, big), await boundary(database, small)
        log(f"boundaries: 100k after id {big.after_message_id}, 1k after id {small.after_message_id}")
        samples = await measure(client, big, small)
        await explain_case(database, big)
        await explain_case(database, small)
    return {
        **big_vs_small(samples, big.label, small.label),
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
