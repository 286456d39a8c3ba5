"""Shared plumbing of the benchmarks: a throwaway database, a transcript server process, results.

Every benchmark follows the same convention: it runs against PostgreSQL on 127.0.0.1:5432 unless
`--database-url` or BENCH_DATABASE_URL names another admin URL, creates its own `bench_<random>`
database, starts the real transcript gRPC server as its own process on port 0, prints progress lines, and
prints exactly one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
from sqlalchemy import Select
from sqlalchemy.ext.asyncio import create_async_engine

from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum.transcript.v1 import transcript_service_pb2_grpc as api_grpc
from continuum_runtime.auth import call_metadata
from continuum_runtime.channels import open_channel
from continuum_transcript.bodies import stored_preview

DEFAULT_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
SERVICE_TOKEN = "bench-service-token"
BENCH_USER = "bench-user"
# Messages live in this schema; the service's engine sets search_path, raw connections do not.
SCHEMA = "transcript"

_STARTED = time.perf_counter()


def log(message: str) -> None:
    """A progress line, stamped with seconds since start; flushed so a slow phase is visible live."""
    print(f"[{time.perf_counter() - _STARTED:7.1f}s] {message}", flush=True)


def parse_args(description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """Common command line: `--database-url` (admin URL of a server where we may create databases);
    `extra` may add a benchmark's own options."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--database-url",
        default=os.environ.get("BENCH_DATABASE_URL", DEFAULT_ADMIN_URL),
        help="admin URL (libpq or postgresql+asyncpg) of the PostgreSQL server; default: %(default)s",
    )
    parser.add_argument("--seed", type=int, default=20251130, help="seed of the synthetic data")
    if extra is not None:
        extra(parser)
    return parser.parse_args()


def libpq_url(url: str) -> str:
    """asyncpg wants a plain libpq URL; accept the SQLAlchemy spelling too."""
    return url.replace("postgresql+asyncpg://", "postgresql://", 1)


@dataclass(frozen=True)
class BenchDatabase:
    """A throwaway database: its libpq URL for raw asyncpg and its URL for the service."""

    name: str
    raw_url: str
    service_url: str


@asynccontextmanager
async def throwaway_database(admin_url: str) -> AsyncIterator[BenchDatabase]:
    """CREATE DATABASE bench_<random>; DROP ... WITH (FORCE) on the way out, even after a failure.

    FORCE because a failed run may leave the service's pool (or a raw connection) still attached.
    """
    admin_url = libpq_url(admin_url)
    name = f"bench_{uuid.uuid4().hex[:12]}"
    await _admin_execute(admin_url, f'CREATE DATABASE "{name}"')
    log(f"created database {name}")
    base, _, _ = admin_url.partition("?")[0].rpartition("/")
    raw_url = f"{base}/{name}"
    try:
        yield BenchDatabase(name, raw_url, raw_url.replace("postgresql://", "postgresql+asyncpg://", 1))
    finally:
        await _admin_execute(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        log(f"dropped database {name}")


async def _admin_execute(admin_url: str, statement: str) -> None:
    """One statement (CREATE or DROP DATABASE) on a short-lived admin connection."""
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(statement)
    finally:
        await admin.close()


@dataclass
class TranscriptClient:
    """A stub to the server process plus the metadata of the benchmark's acting user."""

    stub: api_grpc.TranscriptServiceStub
    metadata: tuple[tuple[str, str], ...]
    server_pid: int
    # host:port of the server process (for other processes that connect to it).
    address: str

    async def create_session(self, session_id: str, title: str, user: str = BENCH_USER) -> str:
        """Create a session of `user` through the API (so its row is exactly what the service writes)."""
        response: api.CreateSessionResponse = await self.stub.CreateSession(
            api.CreateSessionRequest(session_id=session_id, title=title, model="bench-model"),
            metadata=call_metadata(SERVICE_TOKEN, user),
        )
        return str(response.session.session_id)


@dataclass(frozen=True)
class ServiceProcess:
    """A Continuum component running as its own process on port 0."""

    pid: int
    port: int


@asynccontextmanager
async def service_process(argv: Sequence[str], name: str, env: dict[str, str]) -> AsyncIterator[ServiceProcess]:
    """`python -m <argv...>` with `env` added (its `*_DATA_DIR` is given here as `{data_dir}`), until
    its port file appears; terminated on exit, with the CPU it used logged."""
    with tempfile.TemporaryDirectory(prefix=f"continuum-bench-{name}-") as data_dir:
        port_file = Path(data_dir) / "run" / f"{name}.port"
        resolved = {key: value.replace("{data_dir}", data_dir) for key, value in env.items()}
        process = await asyncio.create_subprocess_exec(sys.executable, "-m", *argv, env={**os.environ, **resolved})
        try:
            for _ in range(600):
                if port_file.exists() or process.returncode is not None:
                    break
                await asyncio.sleep(0.05)
            if not port_file.exists():
                raise RuntimeError(f"the {name} server did not start")
            port = int(port_file.read_text())
            log(f"{name} server (pid {process.pid}) listening on 127.0.0.1:{port}")
            yield ServiceProcess(process.pid, port)
        finally:
            if process.returncode is None:
                log(f"{name} server used {process_cpu_seconds(process.pid):.1f} s of CPU")
                process.terminate()
                await process.wait()


@asynccontextmanager
async def transcript_server(database: BenchDatabase) -> AsyncIterator[TranscriptClient]:
    """The real transcript service as its own process (its production shape, so the load
    generator never shares its interpreter), migrated on start, and a client to it."""
    env = {
        "TRANSCRIPT_DATA_DIR": "{data_dir}",
        "TRANSCRIPT_DATABASE_URL": database.service_url,
        "TRANSCRIPT_PORT": "0",
        "TRANSCRIPT_SERVICE_TOKEN": SERVICE_TOKEN,
        "TRANSCRIPT_LOG_LEVEL": "WARNING",
    }
    async with service_process(("continuum_transcript", "serve"), "transcript", env) as process:
        channel = open_channel(f"127.0.0.1:{process.port}")
        try:
            yield TranscriptClient(
                api_grpc.TranscriptServiceStub(channel),
                call_metadata(SERVICE_TOKEN, BENCH_USER),
                process.pid,
                f"127.0.0.1:{process.port}",
            )
        finally:
            await channel.close()


@dataclass(frozen=True)
class GatewayProcess:
    """The gateway running as its own process: where it listens and the bearer token it accepts."""

    host: str
    port: int
    pid: int
    # The development bearer token (acting user `GATEWAY_DEV_USER`).
    token: str


# The user the gateway's development token acts as (continuum_gateway.settings.DEV_USER).
GATEWAY_DEV_USER = "dev"
GATEWAY_DEV_TOKEN = "bench-dev-token"


@asynccontextmanager
async def gateway_server(transcript_address: str) -> AsyncIterator[GatewayProcess]:
    """The real HTTP/WebSocket gateway (`python -m continuum_gateway`) as its own process on port 0,
    pointed at a transcript process with the benchmark's service token and a development token."""
    env = {
        "GATEWAY_HOST": "127.0.0.1",
        "GATEWAY_PORT": "0",
        "GATEWAY_DATA_DIR": "{data_dir}",
        "GATEWAY_TRANSCRIPT_ADDRESS": transcript_address,
        "GATEWAY_SERVICE_TOKEN": SERVICE_TOKEN,
        "GATEWAY_DEV_TOKEN": GATEWAY_DEV_TOKEN,
        "GATEWAY_LOG_LEVEL": "WARNING",
    }
    async with service_process(("continuum_gateway",), "gateway", env) as process:
        yield GatewayProcess("127.0.0.1", process.port, process.pid, GATEWAY_DEV_TOKEN)


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# Vocabulary of the synthetic text: prose and code-ish tokens, like a coding-assistant transcript.
_VOCABULARY = (
    "the function returns a list of messages after the boundary and we should check whether "
    "session transcript compaction merge history tool call result assistant user error retry "
    "def async await import from return None self value index query select where order limit "
    "file path src/main.py tests/test_store.py line 42 traceback KeyError ValueError passed failed "
    "refactor the loop so that each batch commits once and the ids come back in order"
)
_WORDS = _VOCABULARY.split()


def synthetic_text(rng: random.Random, size: int) -> str:
    """Exactly `size` bytes (at least 1) of word salad; ASCII, so characters == bytes."""
    size = max(size, 1)
    # One choices() call per message: generating 100k+ messages word by word would take ~10 s.
    text = " ".join(rng.choices(_WORDS, k=size // 4 + 2))
    while len(text) < size:
        text += " " + text
    return text[:size]


@dataclass(frozen=True)
class SyntheticMessage:
    """One message in both shapes a benchmark needs: the API's NewMessage and raw column values."""

    role: int
    text: str
    tool_calls: list[dict[str, str]]
    tool_call_id: str
    metadata: dict[str, Any]

    def new_message(self) -> pb.NewMessage:
        """The message as a client appends it."""
        message = pb.NewMessage(
            role=self.role,  # type: ignore[arg-type]
            content=[pb.ContentPart(text=self.text)],
            tool_calls=[pb.ToolCall(**call) for call in self.tool_calls],
            tool_call_id=self.tool_call_id,
        )
        if self.metadata:
            message.metadata.update(self.metadata)
        return message

    def columns(self, session_id: str, create_ms: int) -> tuple[Any, ...]:
        """Values of MESSAGE_COLUMNS, JSON columns serialized and the body's size and stored preview
        computed as the service writes them."""
        size = self.new_message().ByteSize()
        content = [{"text": self.text}]
        return (
            session_id,
            self.role,
            json.dumps(content),
            json.dumps(self.tool_calls),
            self.tool_call_id,
            json.dumps(self.metadata),
            int(pb.MESSAGE_STATUS_COMPLETE),
            False,
            create_ms,
            size,
            stored_preview(content, size),
        )


MESSAGE_COLUMNS = (
    "session_id",
    "role",
    "content",
    "tool_calls",
    "tool_call_id",
    "metadata",
    "status",
    "deleted",
    "create_ms",
    "body_bytes",
    "preview",
)


class ConversationGenerator:
    """Messages in a plausible agent rhythm: user, assistant calling a tool, tool result, assistant."""

    def __init__(self, rng: random.Random, min_bytes: int, max_bytes: int) -> None:
        self._rng = rng
        self._min = min_bytes
        self._max = max_bytes
        self._step = 0
        self._calls = 0

    def next(self) -> SyntheticMessage:
        """The next message of the conversation."""
        rng = self._rng
        size = rng.randint(self._min, self._max)
        phase = self._step % 4
        self._step += 1
        if phase == 0:
            return SyntheticMessage(pb.MESSAGE_ROLE_USER, synthetic_text(rng, size), [], "", {})
        if phase == 1:
            self._calls += 1
            call = {
                "tool_call_id": f"call_{self._calls:08d}",
                "name": "shell",
                "arguments": json.dumps({"command": "pytest -q tests/test_store.py"}),
            }
            return SyntheticMessage(pb.MESSAGE_ROLE_ASSISTANT, synthetic_text(rng, size), [call], "", {})
        if phase == 2:
            return SyntheticMessage(
                pb.MESSAGE_ROLE_TOOL, synthetic_text(rng, size), [], f"call_{self._calls:08d}", {"exit_code": 0}
            )
        return SyntheticMessage(pb.MESSAGE_ROLE_ASSISTANT, synthetic_text(rng, size), [], "", {})


# The long-session benchmarks (a 100k-message session against a 1k one): their sessions' messages are
# bulk-loaded with COPY a turn at a time, interleaved with other sessions' so that the ids of a
# session are not contiguous and the table is bigger than the sessions read (as in production).
TURN = 4  # messages of one agent turn, written together
NOISE_SESSIONS = 6
NOISE_MESSAGES = 2_000


async def noise_sessions(client: TranscriptClient) -> dict[str, int]:
    """NOISE_SESSIONS other sessions (id -> messages to load) to interleave with the measured ones."""
    sizes: dict[str, int] = {}
    for number in range(NOISE_SESSIONS):
        sizes[await client.create_session(f"bench-noise-{number}", "other traffic")] = NOISE_MESSAGES
    return sizes


def interleaved_rows(rng: random.Random, sizes: Mapping[str, int]) -> Iterator[tuple[Any, ...]]:
    """MESSAGE_COLUMNS rows of every session (id -> messages), a turn at a time in shuffled order so
    sessions interleave; generated lazily (~150 MB of text never sits in memory at once)."""
    schedule = [session_id for session_id, count in sizes.items() for _ in range(count // TURN)]
    rng.shuffle(schedule)
    generators: dict[str, ConversationGenerator] = {}
    start_ms = int(time.time() * 1000) - len(schedule) * TURN * 1000
    for index, session_id in enumerate(schedule):
        generator = generators.setdefault(session_id, ConversationGenerator(rng, 200, 2000))
        for offset in range(TURN):
            yield generator.next().columns(session_id, start_ms + (index * TURN + offset) * 1000)


async def copy_messages(
    database: BenchDatabase,
    sizes: Mapping[str, int],
    records: Iterator[tuple[Any, ...]],
    columns: Sequence[str] = MESSAGE_COLUMNS,
) -> None:
    """Bulk-load the `records` of interleaved_rows(rng, sizes) with COPY, then ANALYZE so the planner
    sees real sizes."""
    total = sum(count // TURN * TURN for count in sizes.values())
    log(f"loading {total:,} messages over {len(sizes)} sessions with COPY ...")
    started = time.perf_counter()
    connection = await asyncpg.connect(database.raw_url)
    try:
        await connection.copy_records_to_table("messages", schema_name=SCHEMA, columns=list(columns), records=records)
        log(f"loaded {total:,} messages in {time.perf_counter() - started:.1f}s; ANALYZE ...")
        await connection.execute(f"ANALYZE {SCHEMA}.messages")
        size = await connection.fetchval(f"SELECT pg_size_pretty(pg_total_relation_size('{SCHEMA}.messages'))")
        log(f"messages table with indexes and TOAST: {size}")
    finally:
        await connection.close()


async def explain(database: BenchDatabase, query: Select[Any], heading: str) -> None:
    """Log the plan of a statement the service runs, rendered exactly as its dialect renders it."""
    # An engine that never connects, only for its dialect.
    dialect = create_async_engine(database.service_url).dialect
    sql = str(query.compile(dialect=dialect, compile_kwargs={"literal_binds": True}))
    connection = await asyncpg.connect(database.raw_url, server_settings={"search_path": SCHEMA})
    try:
        plan = await connection.fetch(f"EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF) {sql}")
    finally:
        await connection.close()
    log(heading)
    for line in plan:
        log(f"    {line[0]}")


async def sample_rotating(
    calls: Mapping[str, Callable[[], Awaitable[float]]], samples: int, *, report_every: int = 100
) -> dict[str, list[float]]:
    """`samples` timed calls (ms) per label, rotating which goes first to cancel drift (with two
    labels: alternating); logs every label's p50 each `report_every` rounds."""
    labels = list(calls)
    result: dict[str, list[float]] = {label: [] for label in labels}
    for index in range(samples):
        shift = index % len(labels)
        for label in labels[shift:] + labels[:shift]:
            result[label].append(await calls[label]())
        if (index + 1) % report_every == 0:
            figures = ", ".join(f"{label} {percentile(values, 0.5):.2f} ms" for label, values in result.items())
            log(f"  {index + 1}/{samples}: p50 {figures}")
    return result


def big_vs_small(samples: Mapping[str, list[float]], big: str, small: str) -> dict[str, Any]:
    """Log p50/p95 per label; the result fields of a big-vs-small latency comparison (ms)."""
    for label, values in samples.items():
        log(f"{label}: p50 {percentile(values, 0.5):.2f} ms, p95 {percentile(values, 0.95):.2f} ms")
    big_ms, small_ms = samples[big], samples[small]
    return {
        "value": percentile(big_ms, 0.5),
        "baseline": percentile(small_ms, 0.5),
        f"p50_{big}_ms": round(percentile(big_ms, 0.5), 3),
        f"p95_{big}_ms": round(percentile(big_ms, 0.95), 3),
        f"p50_{small}_ms": round(percentile(small_ms, 0.5), 3),
        f"p95_{small}_ms": round(percentile(small_ms, 0.95), 3),
        "ratio_p95": round(percentile(big_ms, 0.95) / percentile(small_ms, 0.95), 3),
    }


def percentile(samples: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile (no interpolation: with >=200 samples the difference is noise)."""
    if not samples:
        raise ValueError("no samples")
    ordered = sorted(samples)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]


def emit_result(
    *,
    metric: str,
    value: float,
    baseline: float,
    target: float,
    unit: str,
    higher_is_better: bool,
    valid: bool = True,
    **extra: Any,
) -> None:
    """Print the one-line JSON result (always the last line of a benchmark's output). `valid`
    False (e.g. a follower missed messages) means the target is not met whatever the ratio."""
    ratio = value / baseline if baseline else math.inf
    met = valid and (ratio >= target if higher_is_better else ratio <= target)
    result = {
        "metric": metric,
        "value": round(value, 3),
        "baseline": round(baseline, 3),
        "ratio": round(ratio, 3),
        "target": target,
        "unit": unit,
        "met": met,
        **extra,
    }
    print(json.dumps(result), flush=True)
