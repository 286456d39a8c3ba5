"""Benchmark: BuildContext behind a valid summary boundary must not slow down with the session's length.

Once a session has been compacted, every model request carries the summary plus only the messages
after its boundary. Building that context must cost the same on a 100,000-message session as on a
1,000-message one: compaction validates the boundary with one GetMessage and pages through
transcript's ListMessagesAfter from the boundary on, never over the summarized history. Three
sessions (1,000 / 10,000 / 100,000 messages, appended through the real AppendMessages API) each get
the state a real compaction leaves: transcript's fence raised to the boundary at the session's
history generation and a record in compaction's `session_compactions`, the boundary being the last
message of a whole turn with exactly 50 messages after it; the histories are written interleaved
and the three tails last, turn by turn, so every boundary is equally recent. A fourth session, the
old session in a busy database (`1k_busy`: 1,000 messages, staged the same way), is written whole,
tail included, before any of them: over 100,000 messages of other sessions follow its boundary, so
its context must cost what the 1k session's does however much the table grew after it. Both
services run as their own processes on one fresh PostgreSQL database (each in its own schema);
automatic compaction is off, so the model is never called: this measures context building only. In
the same run, the naive baseline loads the full history of the three sizes through
ListMessagesAfter(after_message_id=0) over every page, what a context builder without a boundary
would have to do (a lower bound: it skips normalization).

    .venv/bin/python bench/build_context.py [--database-url postgresql://postgres@host:5432/postgres]

Result: value = BuildContext p50 latency (ms) on the 100k session, baseline = p50 on the 1k session,
ratio = value / baseline, target: ratio <= 1.5. Extra fields: p50/p95 per size, the naive full
load's p50 per size, `speedup_vs_naive` (naive 100k p50 / BuildContext 100k p50), and the old
session's `p50_1k_busy_ms`, `p95_1k_busy_ms` and `ratio_busy_vs_1k` (its p50 / the 1k session's p50).
`total_messages` counts the three sizes only.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import math
import random
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Run as `python bench/<name>.py`: the repo root must be importable for `bench.bench_support`
# (a package path, so that mypy resolves it the same way as the interpreter does).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import asyncpg

from bench.bench_support import (
    BENCH_USER,
    SCHEMA,
    SERVICE_TOKEN,
    BenchDatabase,
    TranscriptClient,
    emit_result,
    log,
    parse_args,
    percentile,
    sample_rotating,
    service_process,
    synthetic_text,
    throwaway_database,
    transcript_server,
)
from continuum.compaction.events.v1 import events_pb2
from continuum.compaction.v1 import compaction_service_pb2 as capi
from continuum.compaction.v1 import compaction_service_pb2_grpc as capi_grpc
from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum_compaction import SERVICE_NAME as COMPACTION
from continuum_compaction.summarizer import summary_message_text
from continuum_compaction.tables import session_compactions
from continuum_runtime.auth import call_metadata
from continuum_runtime.channels import open_channel

# label -> messages in the session; every count must be even (turns are 2 or 4 messages).
SIZES = {"1k": 1_000, "10k": 10_000, "100k": 100_000}
SMALL, BIG = "1k", "100k"
# The old session in a busy database: written whole before the sizes above, so they all follow it.
BUSY, BUSY_MESSAGES = "1k_busy", 1_000
TAIL = 50  # messages after the boundary, in whole turns starting with a USER message
TOOL_TURN_EVERY = 10  # every 10th turn: user, assistant tool call, tool result, assistant answer
MESSAGE_BYTES = (200, 400)
SUMMARY_BYTES = 1_500
APPEND_BATCH = 1_000  # transcript's max_batch_messages
WARMUP_CALLS = 30
SAMPLES = 200  # BuildContext calls per size
NAIVE_PAGE = 1_000  # ListMessagesAfter's largest page
NAIVE_ITERATIONS = {"1k": 20, "10k": 10, "100k": 5}
TARGET_RATIO = 1.5
RUN_ID = "bench-run"


@dataclass
class Case:
    """One measured session: its message ids in order (filled while appending)."""

    label: str
    session_id: str
    messages: int
    ids: list[int] = field(default_factory=list)

    @property
    def boundary(self) -> int:
        """The last summarized message: the end of the turn right before the tail."""
        return self.ids[self.messages - TAIL - 1]

    @property
    def tail(self) -> list[int]:
        """The ids BuildContext must return after the summary, in order."""
        return self.ids[self.messages - TAIL :]


@dataclass
class CompactionClient:
    """A stub to the compaction process, acting for the benchmark's user."""

    stub: capi_grpc.CompactionServiceStub
    metadata: tuple[tuple[str, str], ...]


@asynccontextmanager
async def compaction_server(database: BenchDatabase, transcript_address: str) -> AsyncIterator[CompactionClient]:
    """The real compaction service (`python -m continuum_compaction serve`) as its own process on port 0,
    migrated on start into its own schema of the same database, pointed at the transcript process.
    Automatic compaction and the session-events consumer are off: no model is ever called."""
    env = {
        "COMPACTION_DATA_DIR": "{data_dir}",
        "COMPACTION_DATABASE_URL": database.service_url,
        "COMPACTION_PORT": "0",
        "COMPACTION_SERVICE_TOKEN": SERVICE_TOKEN,
        "COMPACTION_LOG_LEVEL": "WARNING",
        "COMPACTION_TRANSCRIPT_ADDRESS": transcript_address,
        "COMPACTION_AUTO_COMPACTION": "false",
        "COMPACTION_CONSUME_SESSION_EVENTS": "false",
    }
    async with service_process(("continuum_compaction", "serve"), COMPACTION, env) as process:
        channel = open_channel(f"127.0.0.1:{process.port}")
        try:
            yield CompactionClient(capi_grpc.CompactionServiceStub(channel), call_metadata(SERVICE_TOKEN, BENCH_USER))
        finally:
            await channel.close()


def _text(rng: random.Random) -> str:
    return synthetic_text(rng, rng.randint(*MESSAGE_BYTES))


def _turn(rng: random.Random, number: int, with_tool: bool) -> list[pb.NewMessage]:
    """One whole turn: user + assistant, or user + assistant tool call + tool result + assistant."""
    user = pb.NewMessage(role=pb.MESSAGE_ROLE_USER, content=[pb.ContentPart(text=_text(rng))])
    answer = pb.NewMessage(role=pb.MESSAGE_ROLE_ASSISTANT, content=[pb.ContentPart(text=_text(rng))])
    if not with_tool:
        return [user, answer]
    call_id = f"call_{number:08d}"
    call = pb.NewMessage(
        role=pb.MESSAGE_ROLE_ASSISTANT,
        content=[pb.ContentPart(text=_text(rng))],
        tool_calls=[
            pb.ToolCall(
                tool_call_id=call_id,
                name="shell",
                arguments=json.dumps({"command": "pytest -q tests/test_store.py -k boundary"}),
            )
        ],
    )
    result = pb.NewMessage(role=pb.MESSAGE_ROLE_TOOL, content=[pb.ContentPart(text=_text(rng))], tool_call_id=call_id)
    return [user, call, result, answer]


class Conversation:
    """One session's messages in whole turns; tool-call ids stay unique across the session."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._turns = 0

    def turns(self, count: int) -> Iterator[list[pb.NewMessage]]:
        """Whole turns totalling exactly `count` messages (even: turns are 2 or 4 messages)."""
        if count % 2:
            raise ValueError(f"{count} messages cannot be whole turns")
        remaining = count
        while remaining:
            self._turns += 1
            turn = _turn(self._rng, self._turns, self._turns % TOOL_TURN_EVERY == 0 and remaining >= 4)
            remaining -= len(turn)
            yield turn


def batches(turns: Iterator[list[pb.NewMessage]], size: int) -> Iterator[list[pb.NewMessage]]:
    """Consecutive batches of at most `size` messages."""
    batch: list[pb.NewMessage] = []
    for message in itertools.chain.from_iterable(turns):
        batch.append(message)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def history_schedule(cases: list[Case]) -> list[Case]:
    """The order of the history batches: each session's spread evenly over the whole load, as sessions
    that were active over the same period would have written them."""
    slots: list[tuple[float, int, Case]] = []
    for index, case in enumerate(cases):
        count = math.ceil((case.messages - TAIL) / APPEND_BATCH)
        slots.extend(((number + 1) / count, index, case) for number in range(count))
    return [case for _, _, case in sorted(slots, key=lambda slot: (slot[0], slot[1]))]


async def append(client: TranscriptClient, case: Case, messages: list[pb.NewMessage]) -> None:
    """One AppendMessages call; the ids it returns are added to the case's."""
    response: api.AppendMessagesResponse = await client.stub.AppendMessages(
        api.AppendMessagesRequest(session_id=case.session_id, messages=messages), metadata=client.metadata
    )
    if len(response.message_ids) != len(messages):
        raise AssertionError(f"appended {len(messages)} messages, got {len(response.message_ids)} ids back")
    case.ids.extend(response.message_ids)


async def write_whole(client: TranscriptClient, rng: random.Random, case: Case) -> None:
    """One session written alone, start to end: its history in batches, then its tail a turn per call."""
    conversation = Conversation(rng)
    for batch in batches(conversation.turns(case.messages - TAIL), APPEND_BATCH):
        await append(client, case, batch)
    for turn in conversation.turns(TAIL):
        await append(client, case, turn)


async def load(
    client: TranscriptClient, rng: random.Random, cases: list[Case], early: list[Case], early_rng: random.Random
) -> None:
    """Append every session through AppendMessages: first each `early` session whole (with
    `early_rng`, so the other sessions' data does not depend on them), then the summarized history of
    `cases` in batches interleaved across them, then their TAIL messages a turn per call, round robin.

    The tails of `cases` are the last writes of the table, so each of their boundaries sits equally
    close to its end and the comparison across sizes measures the session's length alone. An early
    session's boundary is followed by every message of `cases`: what it measures is the table after
    the boundary (transcript's pooled, prepared ListMessagesAfter statement may switch to PostgreSQL's
    generic plan; were that plan to walk the primary key from the boundary, it would filter out every
    later message of every other session).
    """
    total = sum(case.messages for case in early + cases)
    for case in early + cases:
        if case.messages % 2 or TAIL % 2 or case.messages <= TAIL:
            raise ValueError(f"session size {case.messages} and tail {TAIL} must be even, the size larger")
    log(f"appending {total:,} messages through AppendMessages (history in batches of {APPEND_BATCH}) ...")
    started = time.perf_counter()
    for case in early:
        await write_whole(client, early_rng, case)
        log(f"  {case.label}: {case.messages:,} messages written whole, before every other session")
    conversations = {case.label: Conversation(rng) for case in cases}
    streams = {
        case.label: batches(conversations[case.label].turns(case.messages - TAIL), APPEND_BATCH) for case in cases
    }
    done = sum(case.messages for case in early)
    for case in history_schedule(cases):
        batch = next(streams[case.label])
        await append(client, case, batch)
        done += len(batch)
        if done // 20_000 != (done - len(batch)) // 20_000:
            log(f"  {done:,}/{total:,} messages")
    if any(next(stream, None) is not None for stream in streams.values()):
        raise AssertionError("the schedule left history batches unwritten")
    tails = {case.label: conversations[case.label].turns(TAIL) for case in cases}
    pending = list(cases)
    while pending:
        for case in list(pending):
            turn = next(tails[case.label], None)
            if turn is None:
                pending.remove(case)
            else:
                await append(client, case, turn)
    elapsed = time.perf_counter() - started
    log(f"appended {total:,} messages in {elapsed:.1f}s ({total / elapsed:,.0f} msgs/s)")
    for case in early + cases:
        if len(case.ids) != case.messages or case.ids != sorted(case.ids):
            raise AssertionError(f"{case.label}: {len(case.ids)} ids, expected {case.messages} ascending")
    if early and max(case.ids[-1] for case in early) >= min(case.ids[0] for case in cases):
        raise AssertionError("an early session's messages are not all older than the other sessions'")


async def stage(client: TranscriptClient, connection: asyncpg.Connection, case: Case, summary: str) -> int:
    """Leave exactly the state a real compaction leaves: transcript's fence raised to the boundary at
    the session's history generation, then compaction's record over that boundary. Returns how many
    messages of all sessions follow the boundary."""
    boundary: api.GetMessageResponse = await client.stub.GetMessage(
        api.GetMessageRequest(session_id=case.session_id, message_id=case.boundary), metadata=client.metadata
    )
    if boundary.message.role != pb.MESSAGE_ROLE_ASSISTANT or boundary.message.deleted:
        raise AssertionError(f"{case.label}: boundary {case.boundary} is not a live assistant message")
    got: api.GetSessionResponse = await client.stub.GetSession(
        api.GetSessionRequest(session_id=case.session_id), metadata=client.metadata
    )
    fence: api.SetCompactionFenceResponse = await client.stub.SetCompactionFence(
        api.SetCompactionFenceRequest(
            session_id=case.session_id,
            message_id=case.boundary,
            expected_history_generation=got.session.history_generation,
            expected_fence_message_id=got.session.compaction_fence_message_id,
        ),
        metadata=client.metadata,
    )
    if fence.message_id != case.boundary:
        raise AssertionError(f"{case.label}: fence at {fence.message_id}, expected {case.boundary}")
    now = int(time.time() * 1000)
    await connection.execute(
        f"INSERT INTO {COMPACTION}.{session_compactions.name} (session_id, summary_text, last_compacted_msg_id,"
        " compact_count, input_tokens, output_tokens, compact_model, create_ms, update_ms)"
        " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        case.session_id,
        summary,
        case.boundary,
        max(1, case.messages // 2_000),
        case.messages * 80,
        max(1, case.messages // 2_000) * 600,
        "bench-summarizer",
        now,
        now,
    )
    later = await connection.fetchval(f"SELECT count(*) FROM {SCHEMA}.messages WHERE message_id > $1", case.boundary)
    log(
        f"{case.label}: {case.messages:,} messages (ids {case.ids[0]}..{case.ids[-1]}), boundary {case.boundary}"
        f" (followed by {later} messages of all sessions), fence raised at history generation"
        f" {got.session.history_generation}"
    )
    return int(later)


def summary_of(case: Case, rng: random.Random) -> str:
    """The staged summary of everything before the case's boundary."""
    opening = f"The user and the assistant worked through {case.messages - TAIL:,} messages. "
    return opening + synthetic_text(rng, SUMMARY_BYTES)


def build_request(case: Case) -> capi.BuildContextRequest:
    """What an agent runtime sends before the first model request of a turn."""
    return capi.BuildContextRequest(
        session_id=case.session_id,
        run_id=RUN_ID,
        trigger_point=capi.TRIGGER_POINT_REQUEST_START,
        system_prompt_sections=[
            capi.PromptSection(
                key="identity",
                label="Identity",
                text="You are a coding assistant working in the user's repository. Be concise and exact.\n",
            ),
            capi.PromptSection(
                key="tools",
                label="Tools",
                text="Use the shell tool to run commands; read files before editing them; run the tests.\n",
            ),
        ],
        skip_auto_compaction=True,
    )


def verify(case: Case, response: capi.BuildContextResponse, summary: str) -> None:
    """The summary first (SYSTEM, message_id 0), then exactly the TAIL messages after the boundary."""
    messages = response.messages
    if len(messages) != TAIL + 1:
        raise AssertionError(f"{case.label}: expected summary + {TAIL} messages, got {len(messages)} messages")
    head = messages[0]
    if head.role != pb.MESSAGE_ROLE_SYSTEM or head.message_id != 0:
        raise AssertionError(f"{case.label}: first message is not the summary (role {head.role}, id {head.message_id})")
    if [part.text for part in head.content] != [summary_message_text(summary)]:
        raise AssertionError(f"{case.label}: the summary message does not carry the staged summary")
    ids = [message.message_id for message in messages[1:]]
    if ids != case.tail or min(ids) <= case.boundary:
        raise AssertionError(f"{case.label}: expected ids {case.tail[0]}..{case.tail[-1]}, got {ids[:3]}...{ids[-3:]}")
    if messages[1].role != pb.MESSAGE_ROLE_USER:
        raise AssertionError(f"{case.label}: the tail does not start with a USER message")
    report = response.compaction
    if (
        response.boundary_message_id != case.boundary
        or report.boundary_was_invalid
        or report.outcome != events_pb2.COMPACTION_OUTCOME_NOT_TRIGGERED
    ):
        raise AssertionError(
            f"{case.label}: boundary {response.boundary_message_id} (expected {case.boundary}),"
            f" invalid={report.boundary_was_invalid}, outcome {events_pb2.CompactionOutcome.Name(report.outcome)}"
        )


async def build_context(client: CompactionClient, case: Case, request: capi.BuildContextRequest, summary: str) -> float:
    """One BuildContext round trip in milliseconds; the response is checked after the clock stops."""
    started = time.perf_counter()
    response: capi.BuildContextResponse = await client.stub.BuildContext(request, metadata=client.metadata)
    elapsed = (time.perf_counter() - started) * 1000
    verify(case, response, summary)
    return elapsed


async def measure(client: CompactionClient, cases: list[Case], summaries: dict[str, str]) -> dict[str, list[float]]:
    """Warm up every session, then SAMPLES calls each, rotating which goes first to cancel drift."""
    calls = {
        case.label: functools.partial(build_context, client, case, build_request(case), summaries[case.label])
        for case in cases
    }
    log(f"warming up ({WARMUP_CALLS} BuildContext calls per size) ...")
    for _ in range(WARMUP_CALLS):
        for call in calls.values():
            await call()
    log(f"measuring {SAMPLES} BuildContext calls per size, rotating the order ...")
    return await sample_rotating(calls, SAMPLES, report_every=50)


async def naive_full_load(client: TranscriptClient, case: Case) -> float:
    """The whole history through ListMessagesAfter(after_message_id=0), every page, in milliseconds."""
    started = time.perf_counter()
    loaded: list[pb.Message] = []
    token = ""
    while True:
        response: api.ListMessagesAfterResponse = await client.stub.ListMessagesAfter(
            api.ListMessagesAfterRequest(
                session_id=case.session_id, after_message_id=0, page_size=NAIVE_PAGE, page_token=token
            ),
            metadata=client.metadata,
        )
        loaded.extend(response.messages)
        token = response.next_page_token
        if not token:
            break
    elapsed = (time.perf_counter() - started) * 1000
    if len(loaded) != case.messages or loaded[-1].message_id != case.ids[-1]:
        raise AssertionError(f"{case.label}: naive load returned {len(loaded)} messages, expected {case.messages}")
    return elapsed


async def measure_naive(client: TranscriptClient, cases: list[Case]) -> dict[str, list[float]]:
    """One warm-up load per size, then NAIVE_ITERATIONS full loads each."""
    samples: dict[str, list[float]] = {}
    for case in cases:
        await naive_full_load(client, case)
        samples[case.label] = [await naive_full_load(client, case) for _ in range(NAIVE_ITERATIONS[case.label])]
        values = samples[case.label]
        log(
            f"naive full load {case.label} ({case.messages:,} messages, {NAIVE_ITERATIONS[case.label]} loads):"
            f" p50 {percentile(values, 0.5):.1f} ms, max {max(values):.1f} ms"
        )
    return samples


async def run(admin_url: str, seed: int) -> dict[str, Any]:
    """The whole benchmark in its own database; returns the result fields."""
    rng = random.Random(seed)
    busy_rng = random.Random(f"{seed}:{BUSY}")  # the sizes' data stays what it was without this session
    async with (
        throwaway_database(admin_url) as database,
        transcript_server(database) as transcript,
        compaction_server(database, transcript.address) as compaction,
    ):
        busy = Case(
            BUSY,
            await transcript.create_session("bench-context-1k-busy", f"{BUSY_MESSAGES:,} messages, written first"),
            BUSY_MESSAGES,
        )
        cases = [
            Case(label, await transcript.create_session(f"bench-context-{label}", f"{count:,} messages"), count)
            for label, count in SIZES.items()
        ]
        await load(transcript, rng, cases, [busy], busy_rng)
        summaries = {case.label: summary_of(case, rng) for case in cases}
        summaries[BUSY] = summary_of(busy, busy_rng)
        connection = await asyncpg.connect(database.raw_url)
        try:
            await connection.execute(f"ANALYZE {SCHEMA}.messages")
            for case in cases:
                await stage(transcript, connection, case, summaries[case.label])
            after_busy = await stage(transcript, connection, busy, summaries[BUSY])
        finally:
            await connection.close()
        if after_busy < SIZES[BIG]:
            raise AssertionError(f"{BUSY}: only {after_busy} messages follow its boundary, expected >= {SIZES[BIG]:,}")
        samples = await measure(compaction, [*cases, busy], summaries)
        for label, values in samples.items():
            log(f"BuildContext {label}: p50 {percentile(values, 0.5):.2f} ms, p95 {percentile(values, 0.95):.2f} ms")
        naive = await measure_naive(transcript, cases)
    p50 = {label: percentile(values, 0.5) for label, values in samples.items()}
    p95 = {label: percentile(values, 0.95) for label, values in samples.items()}
    naive_p50 = {label: percentile(values, 0.5) for label, values in naive.items()}
    speedup = naive_p50[BIG] / p50[BIG]
    log(
        f"BuildContext 100k/1k p50 ratio {p50[BIG] / p50[SMALL]:.3f} (target <= {TARGET_RATIO});"
        f" naive full load 100k p50 {naive_p50[BIG]:.1f} ms = {speedup:.1f}x BuildContext's p50"
    )
    log(
        f"BuildContext {BUSY}/{SMALL} p50 ratio {p50[BUSY] / p50[SMALL]:.3f}"
        f" (the old session's boundary followed by {after_busy:,} messages of all sessions)"
    )
    result: dict[str, Any] = {"value": p50[BIG], "baseline": p50[SMALL]}
    for label in SIZES:
        result[f"p50_{label}_ms"] = round(p50[label], 3)
        result[f"p95_{label}_ms"] = round(p95[label], 3)
    result.update(
        {
            "ratio_10k_vs_1k": round(p50["10k"] / p50[SMALL], 3),
            "ratio_p95": round(p95[BIG] / p95[SMALL], 3),
            "p50_1k_busy_ms": round(p50[BUSY], 3),
            "p95_1k_busy_ms": round(p95[BUSY], 3),
            "ratio_busy_vs_1k": round(p50[BUSY] / p50[SMALL], 3),
            "naive_full_load_1k_ms": round(naive_p50[SMALL], 3),
            "naive_full_load_10k_ms": round(naive_p50["10k"], 3),
            "naive_full_load_100k_ms": round(naive_p50[BIG], 3),
            "speedup_vs_naive": round(speedup, 1),
            "samples_per_size": SAMPLES,
            "naive_iterations_100k": NAIVE_ITERATIONS[BIG],
            "tail_messages": TAIL,
            "total_messages": sum(SIZES.values()),
        }
    )
    return result


def main() -> None:
    """Run, then print the JSON result as the last line (after the database is dropped)."""
    args = parse_args((__doc__ or "").splitlines()[0])
    result = asyncio.run(run(args.database_url, args.seed))
    emit_result(
        metric="build_context_p50_ratio_100k_vs_1k",
        target=TARGET_RATIO,
        unit="ms",
        higher_is_better=False,
        **result,
    )


if __name__ == "__main__":
    main()
