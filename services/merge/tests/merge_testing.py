"""A real transcript and a real merge service on port 0, clients acting for users, and readers of
the conflict details merge attaches (importable as `merge_testing`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import grpc
import pytest
from google.protobuf import duration_pb2
from google.rpc import status_pb2
from grpc_status import rpc_status
from pydantic import SecretStr
from sqlalchemy import update
from transcript_testing import SERVICE_TOKEN, TranscriptClient, append, running_transcript, user

from continuum.merge.v1 import merge_service_pb2 as api
from continuum.merge.v1 import merge_service_pb2_grpc as api_grpc
from continuum.merge.v1 import resources_pb2 as pb
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as tapi
from continuum_merge import store
from continuum_merge.pipeline import Pipeline
from continuum_merge.server import start
from continuum_merge.settings import MergeSettings
from continuum_merge.tables import session_merges
from continuum_merge.worker import Failpoint
from continuum_runtime.auth import call_metadata
from continuum_runtime.channels import open_channel
from continuum_runtime.clock import Clock
from continuum_runtime.database import Database
from continuum_runtime.errors import ErrorDetails, error_details
from continuum_runtime.server import GrpcService

OWNER = "alice"
# An operation as the store tests admit it (see `admitted`).
PARAMETERS = store.Parameters(("a", "b"), "a", "", "")
EXECUTION = store.Execution("model", "title", "/work", "primary-model")
NOW = 1_700_000_000_000
OTHER = "bob"


def merge_database_url(database_url: str) -> str:
    """Merge's own database: another SQLite file, or the same PostgreSQL database (own schema)."""
    if database_url.startswith("sqlite"):
        return database_url.replace("test.db", "merge.db")
    return database_url


def merge_settings(tmp_path: Path, database_url: str, transcript_port: int, **overrides: object) -> MergeSettings:
    """Settings of a test server: port 0, its own data dir, no disk reserve to speak of."""
    values: dict[str, object] = {
        "data_dir": tmp_path / "merge",
        "database_url": merge_database_url(database_url),
        "port": 0,
        "service_token": SecretStr(SERVICE_TOKEN),
        "transcript_address": f"127.0.0.1:{transcript_port}",
        "disk_reserve_bytes": 0,
        "events_retry_seconds": 0.2,
    }
    values.update(overrides)
    return MergeSettings(**values)  # type: ignore[arg-type]


@dataclass
class MergeClient:
    """Clients of transcript and merge acting for any user, and merge's database."""

    transcript: TranscriptClient
    stub: api_grpc.MergeServiceStub
    database: Database

    def user(self, name: str = OWNER) -> tuple[tuple[str, str], ...]:
        """Call metadata acting for `name`."""
        return call_metadata(SERVICE_TOKEN, name)

    async def new_session(self, session_id: str, owner: str = OWNER, parent: str = "", texts: int = 1) -> str:
        """Create a chat session of `owner` (a child of `parent`) with `texts` user messages."""
        await self.transcript.stub.CreateSession(
            tapi.CreateSessionRequest(
                session_id=session_id,
                parent_session_id=parent,
                kind=tpb.SESSION_KIND_SUBTASK if parent else tpb.SESSION_KIND_CHAT,
                title=f"title of {session_id}",
                model="primary-model",
                working_directory=f"/work/{session_id}",
            ),
            metadata=self.user(owner),
        )
        for index in range(texts):
            await append(self.transcript, session_id, user(f"{session_id} message {index}"), owner=owner)
        return session_id

    async def start(
        self, sources: list[str], key: str = "key-1", owner: str = OWNER, **fields: str
    ) -> api.StartMergeResponse:
        """StartMerge with the first source as primary unless given."""
        values: dict[str, str] = {"primary_session_id": sources[0]}
        values.update(fields)
        request = api.StartMergeRequest(source_session_ids=sources, idempotency_key=key, **values)
        response: api.StartMergeResponse = await self.stub.StartMerge(request, metadata=self.user(owner))
        return response

    async def get(self, operation_id: str, owner: str = OWNER) -> pb.MergeOperation:
        """GetMerge."""
        response: api.GetMergeResponse = await self.stub.GetMerge(
            api.GetMergeRequest(operation_id=operation_id), metadata=self.user(owner)
        )
        return response.operation

    async def run_claim(self, session_id: str, owner: str = OWNER) -> str:
        """Take a turn's RUN claim on a session (refused while merge holds it); its claim id."""
        ttl = duration_pb2.Duration()
        ttl.FromTimedelta(timedelta(seconds=60))
        response = await self.transcript.stub.AcquireClaims(
            tapi.AcquireClaimsRequest(session_ids=[session_id], kind=tpb.CLAIM_KIND_RUN, holder="run-1", ttl=ttl),
            metadata=self.user(owner),
        )
        claim_id: str = response.claim.claim_id
        return claim_id

    async def pause(self, operation_id: str, code: str = "DISK_RESERVE") -> None:
        """Pause a preparing operation as its worker would (fenced at its current epoch)."""
        async with self.database.transaction() as connection:
            operation = await store.load(connection, operation_id)
            assert operation is not None
            fence = store.Fence(operation_id, operation.run_epoch, "test")
            assert await store.pause(connection, fence, code, "paused by the test", 0, failed=False)


@dataclass
class MergeStack(MergeClient):
    """A merge service started in this process, with its settings."""

    service: GrpcService
    settings: MergeSettings


@asynccontextmanager
async def running_merge(
    tmp_path: Path,
    database_url: str,
    *,
    clock: Clock | None = None,
    pipeline: Pipeline | None = None,
    failpoint: Failpoint | None = None,
    overrides: Mapping[str, object] | None = None,
) -> AsyncIterator[MergeStack]:
    """Transcript and merge started over `database_url`, with a client for each; the worker runs the
    stages through `pipeline` (none: this merge only answers the API)."""
    async with (
        running_transcript(tmp_path, database_url, clock) as transcript,
        running_merge_service(
            tmp_path, database_url, transcript, clock=clock, pipeline=pipeline, failpoint=failpoint, overrides=overrides
        ) as stack,
    ):
        yield stack


@asynccontextmanager
async def running_merge_service(
    tmp_path: Path,
    database_url: str,
    transcript: TranscriptClient,
    *,
    clock: Clock | None = None,
    pipeline: Pipeline | None = None,
    failpoint: Failpoint | None = None,
    overrides: Mapping[str, object] | None = None,
) -> AsyncIterator[MergeStack]:
    """One more merge replica beside a running transcript (replicas share merge's database)."""
    settings = merge_settings(tmp_path, database_url, transcript.service.port, **(overrides or {}))
    service = await start(settings, clock=clock, pipeline=pipeline, failpoint=failpoint)
    channel = open_channel(f"127.0.0.1:{service.port}")
    database = Database(settings.resolved_database_url("merge"), schema="merge")
    try:
        yield MergeStack(transcript, api_grpc.MergeServiceStub(channel), database, service, settings)
    finally:
        await database.dispose()
        await channel.close()
        await service.stop(grace=0)


async def refused(
    call: Awaitable[object], code: grpc.StatusCode, reason: str
) -> tuple[ErrorDetails, grpc.aio.AioRpcError]:
    """Await `call`, expect it to fail with `code` and ErrorInfo `reason`; its details and the error."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    details = error_details(caught.value)
    assert (details.code, details.reason) == (code, reason), details
    return details, caught.value


def conflict_operation(error: grpc.aio.AioRpcError) -> pb.MergeOperation:
    """The MergeOperation a conflict carries as a status detail."""
    status: status_pb2.Status | None = rpc_status.from_call(error)
    assert status is not None
    for detail in status.details:
        if detail.Is(pb.MergeOperation.DESCRIPTOR):
            operation = pb.MergeOperation()
            detail.Unpack(operation)
            return operation
    raise AssertionError("the conflict carries no MergeOperation")


async def admitted(
    database: Database,
    owner: str = OWNER,
    key: str = "k",
    operation_id: str = "op1",
    now_ms: int = NOW,
    changes: Mapping[str, object] | None = None,
) -> None:
    """Insert an operation of `owner` straight through the store, as StartMerge admits one, with `changes`
    to its row made in the same transaction (so a running worker never sees it as only admitted)."""
    async with database.transaction() as connection:
        assert await store.insert_operation(
            connection,
            operation_id=operation_id,
            owner=owner,
            idempotency_key=key,
            parameters=PARAMETERS,
            target_session_id=f"target-{operation_id}",
            execution=EXECUTION,
            now_ms=now_ms,
            admission_expire_ms=now_ms + 10_000,
        )
        # Admitted: the start's lease ended (the claim and cut are not needed by these tests).
        assert await store.end_admission(connection, operation_id, now_ms)
        if changes:
            await connection.execute(
                update(session_merges).where(session_merges.c.operation_id == operation_id).values(**changes)
            )
