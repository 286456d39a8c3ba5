"""Bad input on every RPC is refused as INVALID_ARGUMENT naming the field, before anything is read."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc
import pytest
from merge_testing import MergeStack, refused

from continuum.merge.v1 import merge_service_pb2 as api
from continuum_runtime.auth import call_metadata
from continuum_runtime.errors import error_details

GOOD = {"source_session_ids": ["a", "b"], "primary_session_id": "a", "idempotency_key": "k"}
OPERATION = "0" * 32


def start(**changes: object) -> api.StartMergeRequest:
    values = {**GOOD, **changes}
    return api.StartMergeRequest(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (start(source_session_ids=["a"]), "source_session_ids"),
        (start(source_session_ids=["a", "b", "c", "d", "e", "f"]), "source_session_ids"),
        (start(source_session_ids=[]), "source_session_ids"),
        (start(source_session_ids=["a", "a"]), "source_session_ids[1]"),
        (start(source_session_ids=["a", "b/../c"]), "source_session_ids[1]"),
        (start(source_session_ids=["a", "x" * 65]), "source_session_ids[1]"),
        (start(primary_session_id=""), "primary_session_id"),
        (start(primary_session_id="c"), "primary_session_id"),
        (start(title="t" * 201), "title"),
        (start(title="line\nbreak"), "title"),
        (start(model="m" * 201), "model"),
        (start(model=" padded"), "model"),
        (start(idempotency_key=""), "idempotency_key"),
        (start(idempotency_key="k" * 129), "idempotency_key"),
        (start(idempotency_key="has space"), "idempotency_key"),
    ],
)
async def test_start_merge(stack: MergeStack, request_: api.StartMergeRequest, field: str) -> None:
    details, _ = await refused(
        stack.stub.StartMerge(request_, metadata=stack.user()), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"
    )
    assert [violation.field for violation in details.violations] == [field]


@pytest.mark.parametrize("operation_id", ["", "short", "G" * 32, "0" * 33, "../" + "0" * 29])
async def test_operation_ids(stack: MergeStack, operation_id: str) -> None:
    calls = [
        stack.stub.GetMerge(api.GetMergeRequest(operation_id=operation_id), metadata=stack.user()),
        stack.stub.CancelMerge(api.CancelMergeRequest(operation_id=operation_id), metadata=stack.user()),
        stack.stub.ResumeMerge(
            api.ResumeMergeRequest(operation_id=operation_id, expected_epoch=1), metadata=stack.user()
        ),
    ]
    for call in calls:
        details, _ = await refused(call, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")
        assert [violation.field for violation in details.violations] == ["operation_id"]


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (api.ResumeMergeRequest(operation_id=OPERATION, expected_epoch=0), "expected_epoch"),
        (api.ResumeMergeRequest(operation_id=OPERATION, expected_epoch=-3), "expected_epoch"),
        (api.ResumeMergeRequest(operation_id=OPERATION, expected_epoch=1, model="m" * 201), "model"),
        (api.ResumeMergeRequest(operation_id=OPERATION, expected_epoch=1, model="bad\tmodel"), "model"),
    ],
)
async def test_resume_merge(stack: MergeStack, request_: api.ResumeMergeRequest, field: str) -> None:
    details, _ = await refused(
        stack.stub.ResumeMerge(request_, metadata=stack.user()), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"
    )
    assert [violation.field for violation in details.violations] == [field]


async def test_every_call_needs_the_credential_and_an_acting_user(stack: MergeStack) -> None:
    calls: dict[str, Callable[[tuple[tuple[str, str], ...]], Awaitable[object]]] = {
        "StartMerge": lambda metadata: stack.stub.StartMerge(start(), metadata=metadata),
        "GetMerge": lambda metadata: stack.stub.GetMerge(
            api.GetMergeRequest(operation_id=OPERATION), metadata=metadata
        ),
        "GetActiveMerge": lambda metadata: stack.stub.GetActiveMerge(api.GetActiveMergeRequest(), metadata=metadata),
        "ResumeMerge": lambda metadata: stack.stub.ResumeMerge(
            api.ResumeMergeRequest(operation_id=OPERATION, expected_epoch=1), metadata=metadata
        ),
        "CancelMerge": lambda metadata: stack.stub.CancelMerge(
            api.CancelMergeRequest(operation_id=OPERATION), metadata=metadata
        ),
    }
    for name, call in calls.items():
        await refused(call(call_metadata("wrong-token", "alice")), grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call(stack.user("bad user!"))
        assert error_details(caught.value).reason == "ACTING_USER_REQUIRED", name
