"""A real transcript, a real merge run to completion with the offline provider, and a real handoff-read
on port 0 (importable as `handoff_testing`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from deadline_testing import eventually
from google.protobuf import duration_pb2
from merge_testing import OWNER, MergeStack, running_merge
from pydantic import SecretStr
from transcript_testing import SERVICE_TOKEN, append, assistant, tool, user

from continuum.handoff_read.v1 import handoff_read_service_pb2 as api
from continuum.handoff_read.v1 import handoff_read_service_pb2_grpc as api_grpc
from continuum.merge.v1 import resources_pb2 as mpb
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as tapi
from continuum_handoff_read.server import start
from continuum_handoff_read.settings import HandoffReadSettings
from continuum_runtime.auth import call_metadata
from continuum_runtime.channels import open_channel
from continuum_runtime.server import GrpcService

# The merge worker's timings, fast enough for a test. Merge's session-events consumer runs: these tests
# delete targets and stop the stack at once, which stops it mid-event (it finishes its database step).
FAST = {
    "worker_poll_seconds": 0.1,
    "lease_renew_seconds": 0.5,
    "lease_ttl_seconds": 5.0,
}


@dataclass
class HandoffStack:
    """Transcript, merge (with a completed merge of two sources) and handoff-read."""

    merge: MergeStack
    stub: api_grpc.HandoffReadServiceStub
    service: GrpcService
    settings: HandoffReadSettings
    # The completed merge: its operation, target session and package directory.
    operation: mpb.MergeOperation

    @property
    def operation_id(self) -> str:
        """The completed merge's operation id."""
        return self.operation.progress.operation_id

    @property
    def target(self) -> str:
        """The merged session."""
        return self.operation.progress.target_session_id

    @property
    def package_dir(self) -> Path:
        """The completed merge's package."""
        return self.merge.settings.resolved_package_root() / self.operation_id

    def user(self, name: str = OWNER) -> tuple[tuple[str, str], ...]:
        """Call metadata acting for `name`."""
        return call_metadata(SERVICE_TOKEN, name)

    async def run(self, session_id: str, run_id: str, owner: str = OWNER) -> None:
        """Take a turn's RUN claim on `session_id` as run `run_id`."""
        ttl = duration_pb2.Duration()
        ttl.FromTimedelta(timedelta(seconds=60))
        await self.merge.transcript.stub.AcquireClaims(
            tapi.AcquireClaimsRequest(session_ids=[session_id], kind=tpb.CLAIM_KIND_RUN, holder=run_id, ttl=ttl),
            metadata=self.user(owner),
        )

    async def reference(self, max_tokens: int = 2048, owner: str = OWNER) -> api.GetHandoffReferenceResponse:
        """GetHandoffReference for the merged session."""
        request = api.GetHandoffReferenceRequest(
            session_id=self.target, merge_operation_id=self.operation_id, max_tokens=max_tokens
        )
        response: api.GetHandoffReferenceResponse = await self.stub.GetHandoffReference(
            request, metadata=self.user(owner)
        )
        return response

    async def execute(
        self, run_id: str, arguments_json: str = '{"action": "list"}', owner: str = OWNER
    ) -> api.ExecuteHandoffReadResponse:
        """ExecuteHandoffRead for run `run_id`."""
        request = api.ExecuteHandoffReadRequest(run_id=run_id, arguments_json=arguments_json)
        response: api.ExecuteHandoffReadResponse = await self.stub.ExecuteHandoffRead(
            request, metadata=self.user(owner)
        )
        return response


def handoff_settings(tmp_path: Path, merge: MergeStack, **overrides: object) -> HandoffReadSettings:
    """Settings of a test server beside `merge`: port 0, merge's package root, both addresses."""
    values: dict[str, object] = {
        "data_dir": tmp_path / "handoff-read",
        "port": 0,
        "service_token": SecretStr(SERVICE_TOKEN),
        "transcript_address": f"127.0.0.1:{merge.transcript.service.port}",
        "merge_address": f"127.0.0.1:{merge.service.port}",
        "package_root": merge.settings.resolved_package_root(),
        "page_token_secret": SecretStr("test-cursor-secret"),
    }
    values.update(overrides)
    return HandoffReadSettings(**values)  # type: ignore[arg-type]


async def completed_merge(merge: MergeStack) -> mpb.MergeOperation:
    """Two sources with a tool round each, merged to completion by the offline provider."""
    for session_id in ("a", "b"):
        await merge.new_session(session_id, texts=1)
        await append(
            merge.transcript,
            session_id,
            assistant(f"{session_id}: reading the API file", f"call-{session_id}"),
            tool(f"call-{session_id}", f"{session_id}: GET /v1/items answers 200"),
            user(f"{session_id}: keep the endpoint; TODO write the client"),
        )
    operation_id = (await merge.start(["a", "b"], title="Both")).operation.progress.operation_id

    async def finished() -> bool:
        status = (await merge.get(operation_id)).progress.status
        assert status in (mpb.MERGE_STATUS_PREPARING, mpb.MERGE_STATUS_COMPLETED)
        return status == mpb.MERGE_STATUS_COMPLETED

    await eventually(finished, what="the merge completed", seconds=90)
    return await merge.get(operation_id)


@asynccontextmanager
async def running_handoff_read(
    tmp_path: Path, merge: MergeStack, **overrides: object
) -> AsyncIterator[tuple[api_grpc.HandoffReadServiceStub, GrpcService, HandoffReadSettings]]:
    """A handoff-read server beside `merge`, and a stub to it."""
    settings = handoff_settings(tmp_path, merge, **overrides)
    service = await start(settings)
    channel = open_channel(f"127.0.0.1:{service.port}")
    try:
        yield api_grpc.HandoffReadServiceStub(channel), service, settings
    finally:
        await channel.close()
        await service.stop(grace=0)


@asynccontextmanager
async def running_handoff(tmp_path: Path, database_url: str) -> AsyncIterator[HandoffStack]:
    """Transcript and merge over `database_url`, a completed merge, and handoff-read beside them."""
    async with running_merge(tmp_path, database_url, overrides=FAST) as merge:
        operation = await completed_merge(merge)
        async with running_handoff_read(tmp_path, merge) as (stub, service, settings):
            yield HandoffStack(merge, stub, service, settings, operation)
