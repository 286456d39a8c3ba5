"""Merges that run, through the gateway: a merge service with its worker and the real stages (the
built-in offline provider) in front of a real transcript. A merge completes and publishes its target;
one paused by the disk reserve resumes at the epoch the caller saw, once."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from deadline_testing import eventually
from gateway_testing import ALICE_TOKEN, SERVICE_TOKEN, assert_error, bearer, gateway_settings, serving
from pydantic import SecretStr

from continuum_gateway.app import create_app
from continuum_merge.server import start as start_merge
from continuum_merge.settings import MergeSettings
from continuum_runtime.server import GrpcService

ALICE = bearer(ALICE_TOKEN)
# More free disk than any machine has: the snapshot pauses at once.
UNREACHABLE_RESERVE = 2**62


@asynccontextmanager
async def merging_gateway(
    transcript: GrpcService, data_dir: Path, *, disk_reserve_bytes: int
) -> AsyncIterator[httpx.AsyncClient]:
    """A gateway in front of `transcript` and a merge service that works on what it admits."""
    settings = MergeSettings(
        data_dir=data_dir / "merge",
        database_url="",
        port=0,
        service_token=SecretStr(SERVICE_TOKEN),
        transcript_address=f"127.0.0.1:{transcript.port}",
        consume_session_events=False,
        disk_reserve_bytes=disk_reserve_bytes,
        worker_poll_seconds=0.1,
        lease_renew_seconds=0.5,
        lease_ttl_seconds=5.0,
    )
    merge = await start_merge(settings)
    try:
        gateway = gateway_settings(
            data_dir / "gateway", f"127.0.0.1:{transcript.port}", merge_address=f"127.0.0.1:{merge.port}"
        )
        async with serving(create_app(gateway)) as client:
            yield client
    finally:
        await merge.stop(grace=5)


async def _start(gateway: httpx.AsyncClient) -> tuple[str, list[str]]:
    """A merge of two new sessions of Alice's: its operation id and the sources."""
    sources = []
    for text in ("we keep 42", "the file says 42"):
        session_id = f"r-{uuid.uuid4().hex[:12]}"
        created = await gateway.post("/v1/sessions", headers=ALICE, json={"sessionId": session_id, "title": text})
        assert created.status_code == 201, created.text
        message = {"role": "MESSAGE_ROLE_USER", "content": [{"text": text}]}
        appended = await gateway.post(
            f"/v1/sessions/{session_id}/messages", headers=ALICE, json={"messages": [message]}
        )
        assert appended.status_code == 200, appended.text
        sources.append(session_id)
    body = {"sourceSessionIds": sources, "primarySessionId": sources[0], "title": "Both", "idempotencyKey": "run"}
    started = await gateway.post("/v1/session-merges", headers=ALICE, json=body)
    assert started.status_code == 201, started.text
    return started.json()["operation"]["progress"]["operationId"], sources


async def _until(gateway: httpx.AsyncClient, operation_id: str, status: str) -> dict[str, Any]:
    """The operation once it reached `status` (read through the gateway)."""
    seen: dict[str, Any] = {}

    async def reached() -> bool:
        response = await gateway.get(f"/v1/session-merges/{operation_id}", headers=ALICE)
        assert response.status_code == 200, response.text
        seen.update(response.json()["operation"])
        return bool(seen["progress"]["status"] == status)

    await eventually(reached, what=lambda: f"{status}, the operation is {seen}", seconds=60, interval=0.1)
    return seen


def _operation_detail(error: dict[str, Any]) -> dict[str, Any]:
    operations: list[dict[str, Any]] = [d for d in error["details"] if "progress" in d]
    assert len(operations) == 1, error
    return operations[0]


async def test_a_merge_publishes_its_target_and_then_cannot_be_cancelled(
    transcript: GrpcService, tmp_path: Path
) -> None:
    async with merging_gateway(transcript, tmp_path, disk_reserve_bytes=0) as gateway:
        operation_id, _ = await _start(gateway)
        done = await _until(gateway, operation_id, "MERGE_STATUS_COMPLETED")
        progress = done["progress"]
        assert (progress["stage"], progress["targetAvailable"], progress["snapshotSealed"]) == (
            "MERGE_STAGE_COMPLETED",
            True,
            True,
        )
        assert (progress["canCancel"], progress["canResume"]) == (False, False)
        target = await gateway.get(f"/v1/sessions/{progress['targetSessionId']}", headers=ALICE)
        assert target.status_code == 200, target.text
        assert (target.json()["session"]["kind"], target.json()["session"]["title"]) == ("SESSION_KIND_MERGED", "Both")

        cancel = await gateway.post(f"/v1/session-merges/{operation_id}:cancel", headers=ALICE)
        error = assert_error(cancel, 409, "FAILED_PRECONDITION", "MERGE_ALREADY_COMPLETED")
        assert _operation_detail(error)["progress"]["status"] == "MERGE_STATUS_COMPLETED"
        assert (await gateway.get("/v1/session-merges:active", headers=ALICE)).status_code == 204


async def test_a_paused_merge_resumes_once_at_the_epoch_the_caller_saw(transcript: GrpcService, tmp_path: Path) -> None:
    async with merging_gateway(transcript, tmp_path, disk_reserve_bytes=UNREACHABLE_RESERVE) as gateway:
        operation_id, _ = await _start(gateway)
        paused = (await _until(gateway, operation_id, "MERGE_STATUS_PAUSED"))["progress"]
        assert (paused["errorCode"], paused["canResume"]) == ("DISK_RESERVE", True)
        epoch = int(paused["runEpoch"])
        resume = f"/v1/session-merges/{operation_id}:resume"

        stale = await gateway.post(resume, headers=ALICE, json={"expectedEpoch": str(epoch + 1)})
        error = assert_error(stale, 409, "FAILED_PRECONDITION", "MERGE_STALE_OPERATION")
        assert _operation_detail(error)["progress"]["status"] == "MERGE_STATUS_PAUSED"

        resumed = await gateway.post(resume, headers=ALICE, json={"expectedEpoch": str(epoch), "model": "other"})
        assert resumed.status_code == 200, resumed.text
        operation = resumed.json()["operation"]
        assert operation["progress"]["status"] == "MERGE_STATUS_PREPARING"
        assert int(operation["progress"]["runEpoch"]) > epoch
        # The same request again (a retry, a second tab) does not resume a second time.
        again = await gateway.post(resume, headers=ALICE, json={"expectedEpoch": str(epoch), "model": "other"})
        assert_error(again, 409, "FAILED_PRECONDITION", "MERGE_STALE_OPERATION")

        cancelled = await gateway.post(f"/v1/session-merges/{operation_id}:cancel", headers=ALICE)
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json()["operation"]["progress"]["status"] == "MERGE_STATUS_CANCELLED"
