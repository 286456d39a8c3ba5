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
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import grpc

from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum.transcript.v1 import transcript_service_pb2_grpc as api_grpc
from continuum_runtime.auth import call_metadata
from continuum_runtime.channels import open_channel

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
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    log(f"created database {name}")
    base, _, _ = admin_url.partition("?")[0].rpartition("/")
    raw_url = f"{base}/{name}"
    try:
        yield BenchDatabase(name, raw_url, raw_url.replace("postgresql://", "postgresql+asyncpg://", 1))
    finally:
        admin = await asyncpg.connect(admin_url)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()
        log(f"dropped database {name}")


@dataclass
class TranscriptClient:
    """A stub to the server process plus the metadata of the benchmark's acting user."""

    stub: api_grpc.TranscriptServiceStub
    channel: grpc.aio.Channel
    metadata: tuple[tuple[str, str], ...]
    server_pid: int
    # host:port of the server process (for other processes that connect to it).
    address: str = ""

    async def create_session(self, session_id: str, title: str) -> str:
        """Create a session through the API (so its row is exactly what the service writes)."""
        response: api.CreateSessionResponse = await self.stub.CreateSession(
            api.CreateSessionRequest(session_id=session_id, title=title, model="bench-model"),
            metadata=self.metadata,
        )
        return str(response.session.session_id)


@dataclass(frozen=True)
class ServiceProcess:
    """A Continuum component running as its own process on port 0."""

    pid: int
    port: int
    data_dir: str


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
            yield ServiceProcess(process.pid, port, data_dir)
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
                channel,
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
        """Values of MESSAGE_COLUMNS, JSON columns serialized as the service stores them."""
        return (
            session_id,
            self.role,
            json.dumps([{"text": self.text}]),
            json.dumps(self.tool_calls),
            self.tool_call_id,
            json.dumps(self.metadata),
            int(pb.MESSAGE_STATUS_COMPLETE),
            False,
            create_ms,
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
