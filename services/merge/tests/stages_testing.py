"""Helpers of the tests through the real stages (importable as `stages_testing`): source trees with tool
rounds, a failpoint that holds a run, the merge service as a killable process (`python -m continuum_merge
serve`) beside a real transcript, and what a recovery test reads afterwards."""

from __future__ import annotations

import asyncio
import signal
from asyncio.subprocess import Process
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from deadline_testing import eventually
from merge_testing import OWNER, merge_settings
from process_testing import serve_module, service_log
from sqlalchemy import select
from transcript_testing import SERVICE_TOKEN, TranscriptClient, append, assistant, tool, user

from continuum.merge.v1 import merge_service_pb2 as api
from continuum.merge.v1 import merge_service_pb2_grpc as api_grpc
from continuum.merge.v1 import resources_pb2 as pb
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as tapi
from continuum_merge.settings import MergeSettings
from continuum_merge.tables import session_merge_attempts, session_merge_units
from continuum_runtime.auth import call_metadata
from continuum_runtime.channels import open_channel
from continuum_runtime.database import Database

# Short leases and polls for a merge server in the test process.
FAST = {
    "lease_ttl_seconds": 2.0,
    "lease_renew_seconds": 0.3,
    "worker_poll_seconds": 0.1,
    "claim_ttl_seconds": 5.0,
    "claim_renew_seconds": 1.0,
    "retry_seconds": 0.2,
}
# Short leases so a killed process's operation is taken over within seconds.
FAST_ENV = {
    "MERGE_LEASE_TTL_SECONDS": "2",
    "MERGE_LEASE_RENEW_SECONDS": "0.3",
    "MERGE_WORKER_POLL_SECONDS": "0.1",
    "MERGE_CLAIM_TTL_SECONDS": "5",
    "MERGE_CLAIM_RENEW_SECONDS": "1",
    "MERGE_RETRY_SECONDS": "0.2",
}
# How much of a merge process's log a failed wait for its crash shows.
LOG_TAIL_LINES = 40
# A tool output large enough that the default extraction budget makes several units of two sources.
TOOL_OUTPUT_BYTES = 30_000


class Hold:
    """A failpoint that holds the run the first time it reaches `point`, until released."""

    def __init__(self, point: str) -> None:
        self.point = point
        self.reached = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, name: str) -> None:
        """Hold at `point` (once)."""
        if name == self.point and not self.reached.is_set():
            self.reached.set()
            await self.release.wait()


def metadata(owner: str = OWNER) -> tuple[tuple[str, str], ...]:
    """Call metadata acting for `owner`."""
    return call_metadata(SERVICE_TOKEN, owner)


async def new_session(transcript: TranscriptClient, session_id: str, parent: str = "") -> None:
    """A chat session (a subtask of `parent`) of the owner, with one user message."""
    await transcript.stub.CreateSession(
        tapi.CreateSessionRequest(
            session_id=session_id,
            parent_session_id=parent,
            kind=tpb.SESSION_KIND_SUBTASK if parent else tpb.SESSION_KIND_CHAT,
            title=f"title of {session_id}",
            model="primary-model",
            working_directory=f"/work/{session_id}",
        ),
        metadata=metadata(),
    )
    await append(transcript, session_id, user(f"{session_id} message 0"))


async def tool_rounds(transcript: TranscriptClient, session_id: str, rounds: int = 2) -> None:
    """A user ask, then `rounds` assistant tool calls each answered by a long tool result."""
    messages = [user(f"{session_id}: please look at the build")]
    for number in range(rounds):
        call = f"{session_id}-call-{number}"
        messages.append(assistant(f"{session_id}: running step {number}", call, arguments='{"cmd": "make"}'))
        messages.append(tool(call, f"{session_id} step {number} output line\n" * (TOOL_OUTPUT_BYTES // 30)))
    messages.append(assistant(f"{session_id}: the build passes now"))
    await append(transcript, session_id, *messages)


async def two_sources(transcript: TranscriptClient) -> None:
    """Sources a and b with tool rounds; b has a child session."""
    for session_id in ("a", "b"):
        await new_session(transcript, session_id)
        await tool_rounds(transcript, session_id)
    await new_session(transcript, "b-child", parent="b")


def merge_env(settings: MergeSettings, **extra: str) -> dict[str, str]:
    """The environment of a merge process with these settings' data dir, database and transcript."""
    return {
        "MERGE_DATA_DIR": str(settings.data_dir),
        "MERGE_PACKAGE_ROOT": str(settings.resolved_package_root()),
        "MERGE_DATABASE_URL": settings.database_url,
        "MERGE_PORT": "0",
        "MERGE_SERVICE_TOKEN": SERVICE_TOKEN,
        "MERGE_TRANSCRIPT_ADDRESS": settings.transcript_address,
        "MERGE_DISK_RESERVE_BYTES": "0",
        "MERGE_CONSUME_SESSION_EVENTS": "false",
        **FAST_ENV,
        **extra,
    }


@dataclass
class MergeProcess:
    """A running merge process and a client of it."""

    process: Process
    stub: api_grpc.MergeServiceStub
    log: Path

    async def crashed(self, operation_id: str, seconds: float = 60) -> int:
        """The exit status once the process ended by itself (a failpoint's kill). If it is still running
        after `seconds`, fail with what the operation and the process's log say it was doing."""
        try:
            return await asyncio.wait_for(self.process.wait(), seconds)
        except TimeoutError:
            pass
        try:
            state = str((await asyncio.wait_for(self.get(operation_id), 10)).progress)
        except (TimeoutError, grpc.RpcError) as error:
            state = f"unknown ({error!r})"
        log = self.log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        raise AssertionError(
            f"the merge process still runs after {seconds} s; operation: {state}\nits log ends:\n" + "\n".join(log)
        )

    async def get(self, operation_id: str) -> pb.MergeOperation:
        """GetMerge as the owner."""
        response: api.GetMergeResponse = await self.stub.GetMerge(
            api.GetMergeRequest(operation_id=operation_id), metadata=metadata()
        )
        return response.operation

    async def start(self, sources: list[str], key: str = "key-1") -> str:
        """StartMerge as the owner; the operation id."""
        response: api.StartMergeResponse = await self.stub.StartMerge(
            api.StartMergeRequest(
                source_session_ids=sources, primary_session_id=sources[0], idempotency_key=key, title="Merged"
            ),
            metadata=metadata(),
        )
        return response.operation.progress.operation_id

    async def completed(self, operation_id: str) -> pb.MergeOperation:
        """The operation once completed (it must stay preparing until then)."""

        async def done() -> bool:
            operation = await self.get(operation_id)
            assert operation.progress.status in (pb.MERGE_STATUS_PREPARING, pb.MERGE_STATUS_COMPLETED), operation
            return operation.progress.status == pb.MERGE_STATUS_COMPLETED

        await eventually(done, what="the merge to complete", seconds=90)
        return await self.get(operation_id)


@asynccontextmanager
async def merge_process(settings: MergeSettings, replica: str = "", **extra: str) -> AsyncIterator[MergeProcess]:
    """`python -m continuum_merge serve` with `settings` (and `extra` MERGE_* variables); stopped with
    SIGTERM at the end unless it already exited (or was killed). A named `replica` runs in a data dir
    of its own (its port file and log) over the same database and package root."""
    data_dir = settings.data_dir / replica if replica else settings.data_dir
    env = merge_env(settings, MERGE_DATA_DIR=str(data_dir), **extra)
    process, port = await serve_module("continuum_merge", "merge", data_dir, env)
    channel = open_channel(f"127.0.0.1:{port}")
    try:
        yield MergeProcess(process, api_grpc.MergeServiceStub(channel), service_log(data_dir, "merge"))
    finally:
        await channel.close()
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), 30)
            except TimeoutError:
                process.kill()
                await process.wait()


def process_settings(tmp_path: Path, database_url: str, transcript: TranscriptClient) -> MergeSettings:
    """The settings the merge processes of a test share (data dir, database, transcript)."""
    return merge_settings(tmp_path, database_url, transcript.service.port)


async def attempts(database: Database, operation_id: str) -> tuple[int, Counter[str]]:
    """How many units the operation has, and its attempts by outcome."""
    async with database.connection() as connection:
        units = (
            await connection.execute(
                select(session_merge_units.c.unit_id).where(session_merge_units.c.operation_id == operation_id)
            )
        ).all()
        outcomes = (
            await connection.execute(
                select(session_merge_attempts.c.outcome).where(session_merge_attempts.c.operation_id == operation_id)
            )
        ).all()
    return len(units), Counter(row.outcome for row in outcomes)


async def merged_sessions(transcript: TranscriptClient) -> list[tpb.Session]:
    """The owner's root sessions of kind MERGED."""
    found: list[tpb.Session] = []
    token = ""
    while True:
        page = await transcript.stub.ListSessions(
            tapi.ListSessionsRequest(page_size=200, page_token=token), metadata=metadata()
        )
        found.extend(session for session in page.sessions if session.kind == tpb.SESSION_KIND_MERGED)
        token = page.next_page_token
        if not token:
            return found
