"""Benchmark: append throughput through the gRPC API against a raw asyncpg `executemany` floor.

Agents append a turn's messages in batches. This measures messages/s through `AppendMessages`
(the real server: auth, validation, session check, one INSERT ... RETURNING per batch, conversion
back to protobuf) with a few concurrent clients, and the same rows written by raw asyncpg
`executemany` in the same batches, with the same concurrency and one transaction per batch, into
the same table. The raw path is what PostgreSQL itself costs; the ratio is the service's efficiency.

    .venv/bin/python bench/append.py [--database-url postgresql://postgres@host:5432/postgres]

Result: value = API messages/s, baseline = raw executemany messages/s, ratio = value / baseline,
target: ratio >= 0.5.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Run as `python bench/<name>.py`: the repo root must be importable for `bench.bench_support`
# (a package path, so that mypy resolves it the same way as the interpreter does).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import asyncpg

from bench.bench_support import (
    MESSAGE_COLUMNS,
    SCHEMA,
    BenchDatabase,
    ConversationGenerator,
    SyntheticMessage,
    TranscriptClient,
    emit_result,
    log,
    parse_args,
    percentile,
    process_cpu_seconds,
    throwaway_database,
    transcript_server,
)
from continuum.transcript.v1 import transcript_service_pb2 as api

CLIENTS = 4
BATCH = 50
# Many short rounds per path, alternating which path goes first, so table growth, drift and bursts of
# other load on the machine fall on both paths alike.
ROUNDS = 20
BATCHES_PER_CLIENT_PER_ROUND = 10  # 4 clients x 10 batches x 50 messages x 20 rounds = 40,000
WARMUP_BATCHES_PER_CLIENT = 3
MESSAGE_BYTES = (400, 600)
TARGET_RATIO = 0.5

INSERT_SQL = (
    f"INSERT INTO {SCHEMA}.messages ({', '.join(MESSAGE_COLUMNS)}) "
    f"VALUES ({', '.join(f'${index}' for index in range(1, len(MESSAGE_COLUMNS) + 1))})"
)


@dataclass
class Tally:
    """Messages written and wall time spent by one path, plus per-batch latencies."""

    messages: int = 0
    seconds: float = 0.0
    batch_ms: list[float] = field(default_factory=list)
    # CPU the server process spent during this path's rounds (API path only).
    server_cpu_seconds: float = 0.0

    @property
    def rate(self) -> float:
        """Messages per second over every measured round."""
        return self.messages / self.seconds if self.seconds else 0.0


def make_batches(rng: random.Random, count: int) -> list[list[SyntheticMessage]]:
    """`count` batches of BATCH messages of ~500 bytes, in a conversation's role rhythm."""
    generator = ConversationGenerator(rng, *MESSAGE_BYTES)
    return [[generator.next() for _ in range(BATCH)] for _ in range(count)]


async def api_client(client: TranscriptClient, requests: list[api.AppendMessagesRequest], tally: Tally) -> None:
    """One client appending its batches one after another, as an agent loop does."""
    for request in requests:
        started = time.perf_counter()
        response: api.AppendMessagesResponse = await client.stub.AppendMessages(request, metadata=client.metadata)
        tally.batch_ms.append((time.perf_counter() - started) * 1000)
        if len(response.message_ids) != len(request.messages):
            raise AssertionError(f"appended {len(request.messages)} messages, got {len(response.message_ids)} ids back")


async def raw_client(connection: asyncpg.Connection, batches: list[list[tuple[Any, ...]]], tally: Tally) -> None:
    """The floor: the same rows, one executemany and one commit per batch, no service in between."""
    for rows in batches:
        started = time.perf_counter()
        async with connection.transaction():
            await connection.executemany(INSERT_SQL, rows)
        tally.batch_ms.append((time.perf_counter() - started) * 1000)


async def timed(label: str, tally: Tally, messages: int, work: Callable[[Tally], list[Awaitable[None]]]) -> None:
    """Run one round of concurrent clients and add its messages and wall time to `tally`."""
    started = time.perf_counter()
    await asyncio.gather(*work(tally))
    elapsed = time.perf_counter() - started
    tally.messages += messages
    tally.seconds += elapsed
    log(f"  {label}: {messages:,} messages in {elapsed:.2f}s = {messages / elapsed:,.0f} msgs/s")


async def run(admin_url: str, seed: int) -> dict[str, Any]:
    """The whole benchmark in its own database; returns the result fields."""
    rng = random.Random(seed)
    per_client = WARMUP_BATCHES_PER_CLIENT + ROUNDS * BATCHES_PER_CLIENT_PER_ROUND
    log(f"generating {CLIENTS} x {per_client} batches of {BATCH} messages ...")
    # The same synthetic messages feed both paths; each path only serializes them its own way, and
    # that client-side preparation (the API path's requests, the raw path's column tuples) is done
    # up front so neither path's timing includes it.
    synthetic = [make_batches(rng, per_client) for _ in range(CLIENTS)]
    api_batches = [[[m.new_message() for m in batch] for batch in batches] for batches in synthetic]
    mean_bytes = sum(m.ByteSize() for batch in api_batches[0] for m in batch) / (per_client * BATCH)
    log(f"mean NewMessage size {mean_bytes:.0f} bytes")
    api_tally, raw_tally = Tally(), Tally()
    async with throwaway_database(admin_url) as database, transcript_server(database) as client:
        api_sessions = [await client.create_session(f"bench-api-{n}", "append via API") for n in range(CLIENTS)]
        raw_sessions = [await client.create_session(f"bench-raw-{n}", "append via asyncpg") for n in range(CLIENTS)]
        api_requests = [
            [api.AppendMessagesRequest(session_id=api_sessions[n], messages=batch) for batch in api_batches[n]]
            for n in range(CLIENTS)
        ]
        create_ms = int(time.time() * 1000)
        raw_batches = [
            [[message.columns(raw_sessions[n], create_ms) for message in batch] for batch in synthetic[n]]
            for n in range(CLIENTS)
        ]
        connections = [await asyncpg.connect(database.raw_url) for _ in range(CLIENTS)]
        try:
            await measure(client, connections, api_requests, raw_batches, api_tally, raw_tally)
            await verify(database, api_sessions, raw_sessions, per_client * BATCH)
        finally:
            for connection in connections:
                await connection.close()
    for label, tally in (("API", api_tally), ("raw executemany", raw_tally)):
        log(
            f"{label}: {tally.rate:,.0f} msgs/s; batch of {BATCH}: p50 {percentile(tally.batch_ms, 0.5):.1f} ms,"
            f" p95 {percentile(tally.batch_ms, 0.95):.1f} ms"
        )
    return {
        "value": api_tally.rate,
        "baseline": raw_tally.rate,
        "api_messages": api_tally.messages,
        "raw_messages": raw_tally.messages,
        "clients": CLIENTS,
        "batch_size": BATCH,
        "mean_message_bytes": round(mean_bytes),
        "api_batch_p50_ms": round(percentile(api_tally.batch_ms, 0.5), 2),
        "api_batch_p95_ms": round(percentile(api_tally.batch_ms, 0.95), 2),
        "raw_batch_p50_ms": round(percentile(raw_tally.batch_ms, 0.5), 2),
        "raw_batch_p95_ms": round(percentile(raw_tally.batch_ms, 0.95), 2),
        "server_cpu_ms_per_batch": round(api_tally.server_cpu_seconds * 1000 * BATCH / api_tally.messages, 2),
    }


async def measure(
    client: TranscriptClient,
    connections: list[asyncpg.Connection],
    api_requests: list[list[api.AppendMessagesRequest]],
    raw_batches: list[list[list[tuple[Any, ...]]]],
    api_tally: Tally,
    raw_tally: Tally,
) -> None:
    """Warm both paths up, then alternate rounds of each (API first, then raw first, ...)."""

    def api_round(start: int, stop: int) -> Callable[[Tally], list[Awaitable[None]]]:
        return lambda tally: [api_client(client, api_requests[n][start:stop], tally) for n in range(CLIENTS)]

    def raw_round(start: int, stop: int) -> Callable[[Tally], list[Awaitable[None]]]:
        return lambda tally: [raw_client(connections[n], raw_batches[n][start:stop], tally) for n in range(CLIENTS)]

    warm = WARMUP_BATCHES_PER_CLIENT
    log(f"warming up both paths ({warm} batches per client) ...")
    await asyncio.gather(*api_round(0, warm)(Tally()), *raw_round(0, warm)(Tally()))
    round_messages = CLIENTS * BATCHES_PER_CLIENT_PER_ROUND * BATCH
    for number in range(ROUNDS):
        start = warm + number * BATCHES_PER_CLIENT_PER_ROUND
        stop = start + BATCHES_PER_CLIENT_PER_ROUND
        log(f"round {number + 1}/{ROUNDS}: {CLIENTS} concurrent clients, {round_messages:,} messages per path")
        paths = [("API", api_tally, api_round(start, stop)), ("raw", raw_tally, raw_round(start, stop))]
        if number % 2:
            paths.reverse()
        for label, tally, work in paths:
            cpu_before = process_cpu_seconds(client.server_pid)
            await timed(label, tally, round_messages, work)
            if tally is api_tally:
                api_tally.server_cpu_seconds += process_cpu_seconds(client.server_pid) - cpu_before


async def verify(database: BenchDatabase, api_sessions: list[str], raw_sessions: list[str], expected: int) -> None:
    """Every message of both paths (warm-up included) must be stored exactly once."""
    connection = await asyncpg.connect(database.raw_url)
    try:
        counts = dict(
            await connection.fetch(
                f"SELECT session_id, count(*) FROM {SCHEMA}.messages GROUP BY session_id ORDER BY session_id"
            )
        )
    finally:
        await connection.close()
    wrong = {s: counts.get(s, 0) for s in [*api_sessions, *raw_sessions] if counts.get(s, 0) != expected}
    if wrong:
        raise AssertionError(f"expected {expected} messages per session, found {wrong}")
    log(f"verified: {expected:,} messages in each of {len(api_sessions) + len(raw_sessions)} sessions")


def main() -> None:
    """Run, then print the JSON result as the last line (after the database is dropped)."""
    args = parse_args((__doc__ or "").splitlines()[0])
    result = asyncio.run(run(args.database_url, args.seed))
    emit_result(
        metric="append_messages_throughput_vs_raw_executemany",
        target=TARGET_RATIO,
        unit="messages/s",
        higher_is_better=True,
        **result,
    )


if __name__ == "__main__":
    main()
