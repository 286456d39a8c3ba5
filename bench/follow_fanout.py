"""Benchmark: Follow fan-out, one publisher to gRPC and WebSocket followers, against a bare broadcast.

One publisher streams sampling attempts (OpenAttempt, AppendChunks, CommitAttempt) and batches of
further messages (PublishBatch) into one session of the real transcript server; half of the
followers Follow it over gRPC straight from transcript, the other half over the gateway's
WebSocket route (`/v1/sessions/{id}/follow`: the real gateway, its own process, relaying from
transcript, authenticated with its development token). Every process is its own: transcript,
gateway, the publisher (this process) and the followers, spread over a few client processes so
that they never share an interpreter with a server. PostgreSQL persists behind the fan-out.

Saturated part: the publisher never runs more than `--window` frames ahead of the slowest
follower (followers report their progress through shared memory), so this measures the rate the
system sustains without anyone overflowing a bounded queue, not how fast requests are accepted.
Chunks go out `--chunks-per-call` per AppendChunks (each still one frame per follower). Every
chunk carries its publish time (`t=<perf_counter_ns>;`, CLOCK_MONOTONIC, comparable across
processes) and followers compute publish-to-delivery latency on receipt; at saturation that
latency is mostly the window's queue (window / frames per second per follower).
Paced part: the last `--paced-attempts` attempts start once every follower has everything and
send one chunk every PACED_INTERVAL_SECONDS (stamped `p=`): latency without a backlog.

Baseline, same run: a bare grpc.aio server (its own process) that sends the very frames of the
saturated part, as one gRPC follower received them (serialized FollowResponse bytes captured in
the system run), from memory to as many gRPC followers as the system had followers in total
(400 by default), through the same follower code in the same number of client processes. A bare
server has no WebSocket side, so its WebSocket followers become gRPC followers: the same number
of streams and frames, the floor of the transport that both paths start from.

    .venv/bin/python bench/follow_fanout.py [--database-url ...] [--attempts N --chunks N ...]

Result: value = delivered frames/s of the system (saturated-part frames received by all
followers / wall time from the first publish to the last of them received), baseline = the bare
broadcast's frames/s (from its start to the last frame received), ratio = value / baseline,
target >= 0.5; latency p50/p99 per transport, saturated and paced; CPU per delivered frame of the
servers and of the clients in both phases; every follower must receive every committed message,
chunk and settlement (mismatches are counted and printed).

Scale: the issue's shape is 1,000 committed messages and 20,000 chunks to 200 + 200 followers,
about 23 frames per message: 9.2 million frame deliveries. Here (2 cores) the system delivers
9,500-11,500 frames/s (since the gateway shares one upstream stream and one JSON text per frame
among a session's WebSocket followers; about 3,500 before) and a bare Python gRPC server
12,000-13,000, so that shape would take about half an hour (both phases together). The
default keeps 1,000 committed messages and 200 + 200 followers but streams 50 attempts x 20
chunks (1,000 chunks) and commits the other 950 messages in batches after the attempts (1,200
frames per follower, 480,000 deliveries), which runs in about 2 minutes. `--attempts 1000` runs
the full shape.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import queue
import random
import resource
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.context import SpawnProcess
from multiprocessing.queues import Queue as ProcessQueue
from pathlib import Path
from typing import Any

# Run as `python bench/<name>.py`: the repo root must be importable for `bench.bench_support`
# (a package path, so that mypy resolves it the same way as the interpreter does).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
from websockets.asyncio.client import connect as ws_connect
from websockets.typing import Subprotocol

from bench.bench_support import (
    GATEWAY_DEV_USER,
    SERVICE_TOKEN,
    ConversationGenerator,
    emit_result,
    gateway_server,
    log,
    parse_args,
    percentile,
    process_cpu_seconds,
    synthetic_text,
    throwaway_database,
    transcript_server,
)
from continuum.transcript.v1 import follow_pb2 as fpb
from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum.transcript.v1 import transcript_service_pb2_grpc as api_grpc
from continuum_runtime.auth import call_metadata
from continuum_runtime.channels import open_channel
from continuum_runtime.wire_names import TRANSCRIPT_V2

GRPC_FOLLOWERS = 200
WS_FOLLOWERS = 200
# Client processes per transport (2 cores: a few processes, each an event loop of many followers).
PROCESSES_PER_TRANSPORT = 2
ATTEMPTS = 50
CHUNKS_PER_ATTEMPT = 20
# Chunks per AppendChunks call. One RPC per chunk makes the publisher's round trips (over 100 ms
# each while 400 streams are busy) the bottleneck instead of the fan-out.
CHUNKS_PER_CALL = 10
COMMITTED_MESSAGES = 1_000
# Frames the publisher may run ahead of the slowest follower (about one attempt's). At saturation
# this queue is what publish-to-delivery latency measures: window / frames per second per follower.
WINDOW_FRAMES = 24
# The last attempts are paced, one chunk per interval (about 800 frames/s to 400 followers, a
# quarter of what the system sustains here): latency without a backlog.
PACED_ATTEMPTS = 1
PACED_INTERVAL_SECONDS = 0.5
CHUNK_BYTES = 32
MESSAGE_BYTES = (200, 800)
TARGET_RATIO = 0.5
# Give up on a phase (and report what arrived) after this long, or longer for a big plan.
PHASE_TIMEOUT_SECONDS = 200.0
SLOWEST_EXPECTED_FRAMES_PER_SECOND = 1_000
CONNECT_CONCURRENCY = 20
# The publisher gives up when the slowest follower makes no progress for this long.
STALL_SECONDS = 60.0
CAPABILITY = TRANSCRIPT_V2
FOLLOW_SUBPROTOCOL = "continuum.follow.v1"
FOLLOW_METHOD = "Follow"
SERVICE_NAME = api.DESCRIPTOR.services_by_name["TranscriptService"].full_name


@dataclass(frozen=True)
class Plan:
    """What the publisher streams: attempts of `chunks` chunks, each committed, and after each
    attempt a batch of `extras[k]` more messages (tool results, user prompts)."""

    attempts: int
    chunks: int
    extras: tuple[int, ...]

    @classmethod
    def of(cls, attempts: int, chunks: int, messages: int) -> Plan:
        """Spread `messages - attempts` extra messages as evenly as possible over the attempts."""
        if attempts < 1 or chunks < 1 or messages < attempts:
            raise SystemExit("need attempts >= 1, chunks >= 1 and messages >= attempts")
        base, remainder = divmod(messages - attempts, attempts)
        return cls(attempts, chunks, tuple(base + (1 if k < remainder else 0) for k in range(attempts)))

    def frames_of(self, attempt: int) -> int:
        """attempt_opened, the chunks, the commit's batch, its settlement, the extra batch."""
        return 1 + self.chunks + 2 + (1 if self.extras[attempt] else 0)

    def frames_before(self, attempt: int) -> int:
        """Frames of every attempt before `attempt`."""
        return sum(self.frames_of(k) for k in range(attempt))

    @property
    def frames(self) -> int:
        """Suffix frames one follower receives."""
        return self.frames_before(self.attempts)

    @property
    def messages(self) -> int:
        """Committed messages."""
        return self.attempts + sum(self.extras)

    def through(self, attempts: int) -> Expected:
        """What a follower receives from the first `attempts` attempts."""
        return Expected(
            frames=self.frames_before(attempts),
            messages=attempts + sum(self.extras[:attempts]),
            chunks=attempts * self.chunks,
            settlements=attempts,
        )

    def stream(self, paced: int) -> Stream:
        """Everything, with the saturated part ending before the last `paced` attempts."""
        return Stream(self.through(self.attempts), self.frames_before(self.attempts - paced))


@dataclass(frozen=True)
class Expected:
    """What every follower must receive."""

    frames: int
    messages: int
    chunks: int
    settlements: int


@dataclass(frozen=True)
class Stream:
    """What a follower expects: the totals and where the saturated part ends (frames/s is
    measured up to there; the paced attempts after it measure latency without queueing)."""

    totals: Expected
    bulk_frames: int


@dataclass(frozen=True)
class FollowerJob:
    """One client process: `count` followers of one transport."""

    kind: str  # "grpc" or "ws"
    slot: int
    count: int
    # gRPC: host:port; WebSocket: the Follow URL.
    target: str
    session_id: str
    user: str
    token: str
    expected: Stream
    # True: a bare broadcast (no handshake, no snapshot; chunk stamps are stale, no latency).
    baseline: bool
    capture: bool
    timeout_seconds: float


@dataclass
class Follower:
    """What one follower received."""

    frames: int = 0
    messages: int = 0
    chunks: int = 0
    settlements: int = 0
    last_message_id: int = 0
    latencies_ns: list[int] = field(default_factory=list)
    paced_ns: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    # When the last frame of the saturated part arrived.
    bulk_ns: int = 0
    captured: list[bytes] | None = None
    # Ended before receiving everything (an error, a resync).
    gone: bool = False

    def batch(self, message_ids: Iterable[int]) -> None:
        """Count a batch's messages; their ids must keep increasing across batches."""
        for message_id in message_ids:
            if message_id <= self.last_message_id:
                self.errors.append(f"message id {message_id} out of order")
            self.last_message_id = message_id
            self.messages += 1

    def counted(self, bulk: int, expected: int) -> bool:
        """Count one suffix frame (stamping the end of the saturated part at frame `bulk`); True once
        all `expected` frames arrived."""
        self.frames += 1
        if self.frames == bulk:
            self.bulk_ns = time.perf_counter_ns()
        return self.frames == expected


@dataclass
class ProcessResult:
    """What one client process sends back."""

    slot: int
    kind: str
    followers: int
    frames: int
    # Every frame received, paced part included (for CPU per frame).
    all_frames: int
    bulk_ns: int
    latencies_ms: list[float]
    paced_ms: list[float]
    mismatches: list[str]
    cpu_seconds: float
    captured: list[bytes] | None


# The client processes.


def follower_process(job: FollowerJob, progress: Any, events: ProcessQueue[tuple[str, int, Any]]) -> None:
    """Entry point of a client process (spawned): run the followers, report the result."""
    try:
        result = asyncio.run(_run_followers(job, progress, events))
    except BaseException as error:  # report anything: the parent must not wait for nothing
        events.put(("error", job.slot, f"{type(error).__name__}: {error}"))
        raise
    events.put(("result", job.slot, result))


class Readiness:
    """Counts followers that went live (or failed before); announces the process ready once all did."""

    def __init__(self, count: int) -> None:
        self._left = count
        self.live = 0
        self.event = asyncio.Event()
        # The process's CPU once every follower was live (start-up and connecting excluded).
        self.cpu_seconds = 0.0
        self.announced = False

    def settled(self, *, live: bool) -> None:
        """One follower is past its snapshot (`live`) or gave up before it."""
        self.live += live
        self._left -= 1
        if self._left == 0:
            self.event.set()


async def _run_followers(job: FollowerJob, progress: Any, events: ProcessQueue[tuple[str, int, Any]]) -> ProcessResult:
    followers = [Follower() for _ in range(job.count)]
    if job.capture:
        followers[0].captured = []
    readiness = Readiness(job.count)
    connecting = asyncio.Semaphore(CONNECT_CONCURRENCY)
    channel: grpc.aio.Channel | None = None
    if job.kind == "grpc":
        channel = open_channel(job.target)
        stub = api_grpc.TranscriptServiceStub(channel)
        metadata = call_metadata(job.token, job.user)
        request = api.FollowRequest(session_id=job.session_id, capabilities=[CAPABILITY])
        tasks = [
            asyncio.create_task(_grpc_follower(stub, request, metadata, follower, job, connecting, readiness))
            for follower in followers
        ]
    else:
        tasks = [asyncio.create_task(_ws_follower(job, follower, connecting, readiness)) for follower in followers]

    def ready() -> None:
        if not readiness.announced:
            readiness.announced = True
            readiness.cpu_seconds = _cpu_seconds()
            events.put(("ready", job.slot, readiness.live))

    async def announce() -> None:
        await readiness.event.wait()
        ready()

    helpers = [
        asyncio.create_task(announce()),
        asyncio.create_task(_report_progress(followers, progress, job.slot, job.expected.totals.frames)),
    ]
    try:
        async with asyncio.timeout(job.timeout_seconds):
            await asyncio.gather(*tasks, return_exceptions=True)
    except TimeoutError:
        pass
    finally:
        for task in [*tasks, *helpers]:
            task.cancel()
        await asyncio.gather(*tasks, *helpers, return_exceptions=True)
        if channel is not None:
            await channel.close()
    _publish_progress(followers, progress, job.slot, job.expected.totals.frames)
    ready()  # even when every follower failed before going live: "ready" always precedes "result"
    return _summarize(job, followers, readiness.cpu_seconds)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _report_progress(followers: list[Follower], progress: Any, slot: int, expected: int) -> None:
    """The slowest follower's frame count, where the publisher can see it. A follower that gave up
    (reported as a mismatch) no longer holds the publisher back."""
    while True:
        _publish_progress(followers, progress, slot, expected)
        await asyncio.sleep(0.005)


def _publish_progress(followers: list[Follower], progress: Any, slot: int, expected: int) -> None:
    progress[slot] = min((f.frames for f in followers if not f.gone), default=expected)


def _summarize(job: FollowerJob, followers: list[Follower], cpu_when_ready: float) -> ProcessResult:
    expected = job.expected.totals
    mismatches = []
    latencies_ms: list[float] = []
    paced_ms: list[float] = []
    for number, follower in enumerate(followers):
        got = Expected(follower.frames, follower.messages, follower.chunks, follower.settlements)
        if got != expected or follower.errors:
            mismatches.append(f"{job.kind}[{job.slot}:{number}] got {got}, errors {follower.errors[:3]}")
        latencies_ms.extend(value / 1e6 for value in follower.latencies_ns)
        paced_ms.extend(value / 1e6 for value in follower.paced_ns)
    return ProcessResult(
        slot=job.slot,
        kind=job.kind,
        followers=len(followers),
        # Frames of the saturated part (what frames/s counts).
        frames=sum(min(follower.frames, job.expected.bulk_frames) for follower in followers),
        all_frames=sum(follower.frames for follower in followers),
        bulk_ns=max(follower.bulk_ns for follower in followers),
        latencies_ms=latencies_ms,
        paced_ms=paced_ms,
        mismatches=mismatches,
        cpu_seconds=_cpu_seconds() - cpu_when_ready,
        captured=followers[0].captured,
    )


def _latency(follower: Follower, text: str) -> None:
    """Publish-to-delivery latency from the chunk's `t=<ns>;` (saturated) or `p=<ns>;` (paced) stamp."""
    latency = time.perf_counter_ns() - int(text[2 : text.index(";")])
    (follower.paced_ns if text[0] == "p" else follower.latencies_ns).append(latency)


async def _grpc_follower(
    stub: api_grpc.TranscriptServiceStub,
    request: api.FollowRequest,
    metadata: tuple[tuple[str, str], ...],
    follower: Follower,
    job: FollowerJob,
    connecting: asyncio.Semaphore,
    readiness: Readiness,
) -> None:
    expected, bulk = job.expected.totals.frames, job.expected.bulk_frames
    measure = not job.baseline
    in_suffix = False
    await connecting.acquire()
    call = stub.Follow(request, metadata=metadata)
    if job.baseline:
        # A bare broadcast has no snapshot: the stream is live as soon as it is open.
        in_suffix = True
        connecting.release()
        readiness.settled(live=True)
    try:
        async for frame in call:
            kind = frame.WhichOneof("frame")
            if not in_suffix:
                if kind == "snapshot_end":
                    in_suffix = True
                    connecting.release()
                    readiness.settled(live=True)
                continue
            if kind == "chunk":
                if measure:
                    _latency(follower, frame.chunk.text)
                follower.chunks += 1
            elif kind == "batch":
                follower.batch(message.message_id for message in frame.batch.messages)
            elif kind == "settlement":
                follower.settlements += 1
            elif kind == "heartbeat":
                continue
            elif kind == "resync":
                follower.errors.append(f"resync {fpb.ResyncReason.Name(frame.resync.reason)}")
                return
            if follower.captured is not None and follower.frames < bulk:
                follower.captured.append(frame.SerializeToString())
            if follower.counted(bulk, expected):
                return
        follower.errors.append("the stream ended early")
    except grpc.aio.AioRpcError as error:
        follower.errors.append(f"{error.code().name}: {error.details()}")
    finally:
        call.cancel()
        _ended(follower, expected, connecting, readiness, in_suffix)


def _ended(
    follower: Follower, expected: int, connecting: asyncio.Semaphore, readiness: Readiness, in_suffix: bool
) -> None:
    if follower.frames < expected:
        follower.gone = True
    if not in_suffix:
        connecting.release()
        readiness.settled(live=False)


async def _ws_follower(
    job: FollowerJob, follower: Follower, connecting: asyncio.Semaphore, readiness: Readiness
) -> None:
    expected, bulk = job.expected.totals.frames, job.expected.bulk_frames
    in_suffix = False
    hello = json.dumps({"type": "hello", "capabilities": [CAPABILITY]})
    await connecting.acquire()
    try:
        async with ws_connect(
            job.target,
            additional_headers={"Authorization": f"Bearer {job.token}"},
            subprotocols=[Subprotocol(FOLLOW_SUBPROTOCOL)],
            proxy=None,
            max_size=None,
            ping_interval=None,
            open_timeout=60,
        ) as socket:
            await socket.send(hello)
            async for message in socket:
                frame = json.loads(message)
                kind = frame["type"]
                if not in_suffix:
                    if kind == "snapshotEnd":
                        in_suffix = True
                        connecting.release()
                        readiness.settled(live=True)
                    elif kind == "error":
                        follower.errors.append(f"error {frame['error']}")
                        return
                    continue
                if kind == "chunk":
                    _latency(follower, frame["chunk"]["text"])
                    follower.chunks += 1
                elif kind == "batch":
                    follower.batch(int(item["messageId"]) for item in frame["batch"]["messages"])
                elif kind == "settlement":
                    follower.settlements += 1
                elif kind == "heartbeat":
                    continue
                elif kind in ("resync", "error"):
                    follower.errors.append(f"{kind} {frame[kind]}")
                    return
                if follower.counted(bulk, expected):
                    return
            follower.errors.append("the socket closed early")
    except Exception as error:  # a refused or dropped socket is a result to report, not a crash
        follower.errors.append(f"{type(error).__name__}: {error}")
    finally:
        _ended(follower, expected, connecting, readiness, in_suffix)


# The bare baseline server.


def baseline_server_process(frames: list[bytes], followers: int, events: ProcessQueue[tuple[str, int, Any]]) -> None:
    """Entry point of the baseline server process (spawned)."""
    asyncio.run(_baseline_server(frames, followers, events))


async def _baseline_server(frames: list[bytes], followers: int, events: ProcessQueue[tuple[str, int, Any]]) -> None:
    """A grpc.aio server answering Follow with the captured frames, from memory, to every stream
    once all `followers` streams are open (so that the clock starts for all of them at once)."""
    server = grpc.aio.server()
    connected = 0
    go = asyncio.Event()

    async def follow(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> Any:
        nonlocal connected
        connected += 1
        if connected == followers:
            events.put(("go", 0, time.perf_counter_ns()))
            go.set()
        await go.wait()
        for frame in frames:
            yield frame

    # No (de)serializers: requests and responses are raw bytes.
    handler = grpc.unary_stream_rpc_method_handler(follow)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE_NAME, {FOLLOW_METHOD: handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    events.put(("port", 0, port))
    await server.wait_for_termination()


# The benchmark.


@dataclass
class Phase:
    """What one phase (system or baseline) delivered."""

    label: str
    frames: int = 0
    seconds: float = 0.0
    results: list[ProcessResult] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        """Frames per second."""
        return self.frames / self.seconds if self.seconds else 0.0

    @property
    def all_frames(self) -> int:
        """Every frame received, paced part included."""
        return sum(result.all_frames for result in self.results)

    @property
    def client_cpu_seconds(self) -> float:
        """CPU of every client process while following (from all followers live to the end)."""
        return sum(result.cpu_seconds for result in self.results)

    def latencies(self, kind: str, *, paced: bool) -> list[float]:
        """Every latency sample of one transport's followers, ms."""
        return [
            value
            for result in self.results
            if result.kind == kind
            for value in (result.paced_ms if paced else result.latencies_ms)
        ]


class Clients:
    """The spawned client processes of one phase and their event queue."""

    def __init__(self, jobs: Sequence[FollowerJob]) -> None:
        self._context = multiprocessing.get_context("spawn")
        self.jobs = list(jobs)
        self.events: ProcessQueue[tuple[str, int, Any]] = self._context.Queue()
        self.progress: Any = self._context.RawArray("q", len(self.jobs))
        self.processes: list[SpawnProcess] = []
        # Results that arrived while waiting for the others to get ready (all followers failed).
        self.stash: list[tuple[str, int, Any]] = []

    def start(self) -> None:
        """Spawn one process per job."""
        for job in self.jobs:
            process = self._context.Process(
                target=follower_process, args=(job, self.progress, self.events), name=f"followers-{job.kind}-{job.slot}"
            )
            process.start()
            self.processes.append(process)

    async def next_event(self, within: float) -> tuple[str, int, Any] | None:
        """The next event of any client process, or None after `within` seconds."""
        if self.stash:
            return self.stash.pop(0)
        try:
            return await asyncio.to_thread(self.events.get, True, within)
        except queue.Empty:
            return None

    def slowest(self) -> int:
        """Frames the slowest follower of all processes has received."""
        return int(min(self.progress[:]))

    def stop(self) -> None:
        """End every client process still running (ours, by handle)."""
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(5)


async def wait_ready(clients: Clients, within: float) -> None:
    """Until every client process has all its followers past their snapshot."""
    ready: set[int] = set()
    stash: list[tuple[str, int, Any]] = []
    live = 0
    deadline = time.monotonic() + within
    while len(ready) < len(clients.jobs):
        event = await clients.next_event(max(0.1, deadline - time.monotonic()))
        if event is None:
            raise RuntimeError(f"only {len(ready)}/{len(clients.jobs)} client processes got ready")
        kind, slot, payload = event
        if kind == "ready":
            ready.add(slot)
            live += payload
        elif kind == "result":
            stash.append(event)
        elif kind == "error":
            raise RuntimeError(f"client process {slot} failed: {payload}")
        else:
            raise RuntimeError(f"unexpected event {kind} from client process {slot} while connecting")
    clients.stash.extend(stash)
    total = sum(job.count for job in clients.jobs)
    if live < total:
        log(f"only {live}/{total} followers went live (the others are reported as mismatches)")


async def collect(clients: Clients, phase: Phase, start_ns: int, within: float) -> None:
    """Gather every client process's result into `phase`."""
    pending = {job.slot for job in clients.jobs}
    deadline = time.monotonic() + within
    while pending:
        event = await clients.next_event(max(0.1, deadline - time.monotonic()))
        if event is None:
            break
        kind, slot, payload = event
        if kind == "result":
            phase.results.append(payload)
            pending.discard(slot)
        elif kind == "error":
            phase.mismatches.append(f"client process {slot} failed: {payload}")
            pending.discard(slot)
    if pending:
        phase.mismatches.append(f"no result from client processes {sorted(pending)}")
    bulk_ns = max((result.bulk_ns for result in phase.results), default=start_ns)
    phase.seconds = (bulk_ns - start_ns) / 1e9
    phase.frames = sum(result.frames for result in phase.results)
    for result in phase.results:
        phase.mismatches.extend(result.mismatches)
    cpu = ", ".join(f"{r.kind}[{r.slot}] {r.cpu_seconds:.1f}s" for r in sorted(phase.results, key=lambda r: r.slot))
    log(
        f"{phase.label}: {phase.frames:,} frames in {phase.seconds:.2f}s = {phase.rate:,.0f} frames/s; client CPU {cpu}"
    )


def chunk_filler(rng: random.Random, plan: Plan) -> list[str]:
    """The text after each chunk's stamp (token-sized pieces of prose)."""
    return [" " + synthetic_text(rng, CHUNK_BYTES - 1) for _ in range(plan.chunks)]


def extra_messages(rng: random.Random, plan: Plan) -> list[list[pb.NewMessage]]:
    """The messages of each attempt's follow-up batch (tool results and prompts)."""
    generator = ConversationGenerator(rng, *MESSAGE_BYTES)
    batches = []
    for count in plan.extras:
        batch: list[pb.NewMessage] = []
        while len(batch) < count:
            message = generator.next()
            if message.role == pb.MESSAGE_ROLE_ASSISTANT:
                continue  # assistant messages come from attempts
            batch.append(message.new_message())
        batches.append(batch)
    return batches


@dataclass
class PublishStats:
    """How the publisher spent its time."""

    started_ns: int = 0
    wait_seconds: float = 0.0
    rpc_ms: list[float] = field(default_factory=list)


async def publish(
    stub: api_grpc.TranscriptServiceStub,
    metadata: tuple[tuple[str, str], ...],
    session_id: str,
    plan: Plan,
    clients: Clients,
    filler: list[str],
    extras: list[list[pb.NewMessage]],
    chunks_per_call: int,
    window: int,
    paced: int,
) -> PublishStats:
    """Stream the plan, never more than `window` frames ahead of the slowest follower. Chunks go out
    `chunks_per_call` per AppendChunks, as a runtime sends the tokens that arrived while its
    previous call was in flight; each frame still carries one chunk.

    The last `paced` attempts start once every follower has everything before them and send one
    chunk every PACED_INTERVAL_SECONDS, stamped `p=`: latency without queueing behind a backlog."""
    stats = PublishStats(started_ns=time.perf_counter_ns())
    last_log = time.monotonic()
    emitted = 0

    async def keep_up(needed: int) -> None:
        """Until the slowest follower has received `needed` frames."""
        if clients.slowest() >= needed:
            return
        waiting = time.monotonic()
        while clients.slowest() < needed:
            if time.monotonic() - waiting > STALL_SECONDS:
                raise RuntimeError(f"followers stalled at frame {clients.slowest()} of {emitted} published")
            await asyncio.sleep(0.002)
        stats.wait_seconds += time.monotonic() - waiting

    async def call(rpc: Any, request: Any, frames: int) -> None:
        nonlocal emitted
        await keep_up(emitted - window)
        started = time.perf_counter()
        await rpc(request, metadata=metadata)
        stats.rpc_ms.append((time.perf_counter() - started) * 1000)
        emitted += frames

    for attempt in range(plan.attempts):
        pacing = attempt >= plan.attempts - paced
        if attempt == plan.attempts - paced:
            log(f"  saturated part published; draining, then {paced} paced attempt(s) ...")
            await keep_up(emitted)
        if time.monotonic() - last_log >= 10:
            last_log = time.monotonic()
            log(f"  attempt {attempt}/{plan.attempts}; slowest follower at frame {clients.slowest():,}/{plan.frames:,}")
        ref = fpb.AttemptRef(message_key=f"bench-{attempt:05d}", attempt=1)
        await call(stub.OpenAttempt, api.OpenAttemptRequest(session_id=session_id, attempt=ref), 1)
        texts: list[str] = []
        per_call = 1 if pacing else chunks_per_call
        for first in range(0, plan.chunks, per_call):
            if pacing:
                await asyncio.sleep(PACED_INTERVAL_SECONDS)
            stamp = f"{'p' if pacing else 't'}={time.perf_counter_ns()};"
            group = [stamp + text for text in filler[first : first + per_call]]
            request = api.AppendChunksRequest(session_id=session_id, attempt=ref, first_chunk_index=first, chunks=group)
            await call(stub.AppendChunks, request, len(group))
            texts.extend(group)
        message = pb.NewMessage(role=pb.MESSAGE_ROLE_ASSISTANT, content=[pb.ContentPart(text="".join(texts))])
        commit = api.CommitAttemptRequest(session_id=session_id, attempt=ref, message=message)
        await call(stub.CommitAttempt, commit, 2)  # its batch and its settlement
        if extras[attempt]:
            operations = [api.BatchOperation(message=m) for m in extras[attempt]]
            await call(stub.PublishBatch, api.PublishBatchRequest(session_id=session_id, operations=operations), 1)
    return stats


def phase_timeout(expected: Stream, followers: int) -> float:
    """How long a phase may take before it is given up (a cap for a hang, not a budget)."""
    return max(PHASE_TIMEOUT_SECONDS, followers * expected.totals.frames / SLOWEST_EXPECTED_FRAMES_PER_SECOND)


def jobs_for(
    kinds: Sequence[tuple[str, int, str, str]],
    session_id: str,
    expected: Stream,
    *,
    baseline: bool,
    capture_slot: int | None,
) -> list[FollowerJob]:
    """Split each transport's followers over PROCESSES_PER_TRANSPORT client processes."""
    jobs: list[FollowerJob] = []
    timeout = phase_timeout(expected, sum(followers for _, followers, _, _ in kinds)) + 60
    for kind, followers, target, token in kinds:
        for part in range(PROCESSES_PER_TRANSPORT):
            count = followers // PROCESSES_PER_TRANSPORT + (1 if part < followers % PROCESSES_PER_TRANSPORT else 0)
            if not count:
                continue
            slot = len(jobs)
            jobs.append(
                FollowerJob(
                    kind=kind,
                    slot=slot,
                    count=count,
                    target=target,
                    session_id=session_id,
                    user=GATEWAY_DEV_USER,
                    token=token,
                    expected=expected,
                    baseline=baseline,
                    capture=slot == capture_slot,
                    timeout_seconds=timeout,
                )
            )
    return jobs


async def system_phase(admin_url: str, plan: Plan, args: argparse.Namespace, rng: random.Random) -> Phase:
    """The real thing: transcript + gateway + PostgreSQL, gRPC and WebSocket followers."""
    phase = Phase("system")
    expected = plan.stream(args.paced_attempts)
    filler, extras = chunk_filler(rng, plan), extra_messages(rng, plan)
    async with throwaway_database(admin_url) as database, transcript_server(database) as client:
        # The session belongs to the gateway's development user, so both transports may follow it.
        session_id = await client.create_session("bench-fanout", "fan-out", user=GATEWAY_DEV_USER)
        metadata = call_metadata(SERVICE_TOKEN, GATEWAY_DEV_USER)
        async with gateway_server(client.address) as gateway:
            url = f"ws://{gateway.host}:{gateway.port}/v1/sessions/{session_id}/follow"
            kinds = [
                ("grpc", args.grpc_followers, client.address, SERVICE_TOKEN),
                ("ws", args.ws_followers, url, gateway.token),
            ]
            clients = Clients(jobs_for(kinds, session_id, expected, baseline=False, capture_slot=0))
            log(
                f"starting {args.grpc_followers} gRPC + {args.ws_followers} WebSocket followers"
                f" in {len(clients.jobs)} client processes ..."
            )
            clients.start()
            try:
                await wait_ready(clients, 90)
                log(
                    f"all followers live; publishing {plan.attempts} attempts x {plan.chunks} chunks and"
                    f" {plan.messages:,} committed messages ({plan.frames:,} frames per follower) ..."
                )
                cpu_before = (process_cpu_seconds(client.server_pid), process_cpu_seconds(gateway.pid))
                stats = await publish(
                    client.stub,
                    metadata,
                    session_id,
                    plan,
                    clients,
                    filler,
                    extras,
                    args.chunks_per_call,
                    args.window,
                    args.paced_attempts,
                )
                published = (time.perf_counter_ns() - stats.started_ns) / 1e9
                rpc_p50, rpc_p99 = percentile(stats.rpc_ms, 0.5), percentile(stats.rpc_ms, 0.99)
                log(
                    f"published with {len(stats.rpc_ms):,} RPCs in {published:.1f}s (RPC p50 {rpc_p50:.1f} ms,"
                    f" p99 {rpc_p99:.1f} ms; {stats.wait_seconds:.1f}s waiting for the slowest follower) ..."
                )
                followers = args.grpc_followers + args.ws_followers
                await collect(clients, phase, stats.started_ns, phase_timeout(expected, followers))
                phase_cpu = (
                    process_cpu_seconds(client.server_pid) - cpu_before[0],
                    process_cpu_seconds(gateway.pid) - cpu_before[1],
                )
                log(f"CPU during the phase: transcript {phase_cpu[0]:.1f}s, gateway {phase_cpu[1]:.1f}s")
                phase.extra = {
                    "server_cpu_s": phase_cpu[0] + phase_cpu[1],
                    "transcript_cpu_s": round(phase_cpu[0], 1),
                    "gateway_cpu_s": round(phase_cpu[1], 1),
                    "publish_rpcs": len(stats.rpc_ms),
                    "publish_rpc_p50_ms": round(rpc_p50, 2),
                    "publisher_wait_s": round(stats.wait_seconds, 1),
                }
            finally:
                clients.stop()
    return phase


async def baseline_phase(frames: list[bytes], followers: int, expected: Stream) -> Phase:
    """The bare broadcast of the captured frames to `followers` gRPC followers."""
    phase = Phase("bare broadcast")
    context = multiprocessing.get_context("spawn")
    events: ProcessQueue[tuple[str, int, Any]] = context.Queue()
    server = context.Process(target=baseline_server_process, args=(frames, followers, events), name="bare-server")
    server.start()
    clients: Clients | None = None
    try:
        kind, _, port = await asyncio.to_thread(events.get, True, 60)
        if kind != "port":
            raise RuntimeError(f"unexpected {kind} from the bare server")
        log(f"bare grpc.aio server (pid {server.pid}) on 127.0.0.1:{port}; {followers} gRPC followers ...")
        # The same client processes: as many as the system had, all gRPC.
        per_transport = [("grpc", followers, f"127.0.0.1:{port}", SERVICE_TOKEN)]
        jobs = jobs_for(per_transport, "bench-fanout", expected, baseline=True, capture_slot=None)
        jobs = _spread(jobs, 2 * PROCESSES_PER_TRANSPORT)
        clients = Clients(jobs)
        clients.start()
        await wait_ready(clients, 90)
        kind, _, go_ns = await asyncio.to_thread(events.get, True, 90)
        if kind != "go" or server.pid is None:
            raise RuntimeError(f"unexpected {kind} from the bare server")
        cpu_at_go = process_cpu_seconds(server.pid)
        await collect(clients, phase, go_ns, phase_timeout(expected, followers))
        phase.extra["server_cpu_s"] = process_cpu_seconds(server.pid) - cpu_at_go
        log(f"bare server used {phase.extra['server_cpu_s']:.1f} s of CPU broadcasting")
    finally:
        if clients is not None:
            clients.stop()
        server.terminate()
        server.join(5)
    return phase


def _spread(jobs: list[FollowerJob], processes: int) -> list[FollowerJob]:
    """Re-split one transport's followers over `processes` client processes."""
    total = sum(job.count for job in jobs)
    return [
        replace(jobs[0], slot=slot, count=total // processes + (1 if slot < total % processes else 0))
        for slot in range(processes)
    ]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """System phase, then the baseline with the frames the system delivered."""
    rng = random.Random(args.seed)
    plan = Plan.of(args.attempts, args.chunks, args.messages)
    if not 0 <= args.paced_attempts < plan.attempts:
        raise SystemExit("need 0 <= paced attempts < attempts")
    system = await system_phase(args.database_url, plan, args, rng)
    captured = next((result.captured for result in system.results if result.captured is not None), None)
    bulk = plan.through(plan.attempts - args.paced_attempts)
    if not captured or len(captured) != bulk.frames:
        raise RuntimeError(f"captured {len(captured or [])} frames, expected {bulk.frames}: {system.mismatches[:5]}")
    # The baseline sends the saturated part's frames, the ones the system's frames/s counts.
    expected = Stream(bulk, bulk.frames)
    followers = args.grpc_followers + args.ws_followers
    baseline = await baseline_phase(captured, followers, expected)
    for line in system.mismatches[:10] + baseline.mismatches[:10]:
        log(f"MISMATCH {line}")
    latency: dict[str, float] = {}
    for kind in ("grpc", "ws"):
        for paced, name, label in ((False, "latency", "saturated"), (True, "paced_latency", "paced")):
            values = system.latencies(kind, paced=paced)
            if not values:
                continue
            p50, p99 = percentile(values, 0.5), percentile(values, 0.99)
            latency[f"{kind}_{name}_p50_ms"] = round(p50, 2)
            latency[f"{kind}_{name}_p99_ms"] = round(p99, 2)
            log(
                f"{kind} publish-to-delivery latency, {label}: p50 {p50:.1f} ms, p99 {p99:.1f} ms"
                f" ({len(values):,} samples)"
            )
    return {
        "value": system.rate,
        "baseline": baseline.rate,
        **latency,
        "grpc_followers": args.grpc_followers,
        "ws_followers": args.ws_followers,
        "baseline_grpc_followers": followers,
        "committed_messages": plan.messages,
        "chunks": plan.attempts * plan.chunks,
        "attempts": plan.attempts,
        "frames_per_follower": plan.frames,
        "saturated_frames_per_follower": bulk.frames,
        "paced_attempts": args.paced_attempts,
        "paced_chunks_per_second": round(1 / PACED_INTERVAL_SECONDS, 1),
        "system_frames": system.frames,
        "system_seconds": round(system.seconds, 2),
        "baseline_frames": baseline.frames,
        "baseline_seconds": round(baseline.seconds, 2),
        "window_frames": args.window,
        "chunks_per_call": args.chunks_per_call,
        # Where the CPU goes, per delivered frame: the servers (transcript + gateway, or the bare
        # server) and the client processes (which share the 2 cores with them).
        "system_server_cpu_us_per_frame": round(system.extra["server_cpu_s"] / system.all_frames * 1e6, 1),
        "bare_server_cpu_us_per_frame": round(baseline.extra.get("server_cpu_s", 0.0) / baseline.all_frames * 1e6, 1),
        "system_client_cpu_us_per_frame": round(system.client_cpu_seconds / system.all_frames * 1e6, 1),
        "bare_client_cpu_us_per_frame": round(baseline.client_cpu_seconds / baseline.all_frames * 1e6, 1),
        "mismatched_followers": len(system.mismatches),
        "baseline_mismatched_followers": len(baseline.mismatches),
        **{key: value for key, value in system.extra.items() if key != "server_cpu_s"},
    }


def options(parser: argparse.ArgumentParser) -> None:
    """This benchmark's scale."""
    parser.add_argument("--attempts", type=int, default=ATTEMPTS, help="sampling attempts, each committed")
    parser.add_argument("--chunks", type=int, default=CHUNKS_PER_ATTEMPT, help="chunks per attempt")
    parser.add_argument(
        "--chunks-per-call", type=int, default=CHUNKS_PER_CALL, help="chunks per AppendChunks call (1: one RPC each)"
    )
    parser.add_argument("--messages", type=int, default=COMMITTED_MESSAGES, help="committed messages in all")
    parser.add_argument(
        "--window", type=int, default=WINDOW_FRAMES, help="frames the publisher may run ahead of the slowest follower"
    )
    parser.add_argument(
        "--paced-attempts", type=int, default=PACED_ATTEMPTS, help="last attempts sent slowly, for latency"
    )
    parser.add_argument("--grpc-followers", type=int, default=GRPC_FOLLOWERS)
    parser.add_argument("--ws-followers", type=int, default=WS_FOLLOWERS)


def main() -> None:
    """Run, then print the JSON result as the last line (after the database is dropped)."""
    args = parse_args((__doc__ or "").splitlines()[0], options)
    result = asyncio.run(run(args))
    emit_result(
        metric="follow_fanout_frames_per_second_vs_bare_grpc_broadcast",
        target=TARGET_RATIO,
        unit="frames/s",
        higher_is_better=True,
        # Every follower must have received every frame, committed message and settlement.
        valid=result["mismatched_followers"] == 0 and result["baseline_mismatched_followers"] == 0,
        **result,
    )


if __name__ == "__main__":
    main()
