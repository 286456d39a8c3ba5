"""The binding of a run (or a merge target) to its package, through the real transcript and merge
services and a package a real merge produced; on SQLite and PostgreSQL."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from handoff_testing import HandoffStack, running_handoff, running_handoff_read
from merge_testing import OTHER, refused
from sqlalchemy import text

from continuum.handoff_read.v1 import handoff_read_service_pb2 as api
from continuum.merge.v1 import merge_service_pb2 as mapi
from continuum.merge.v1 import resources_pb2 as mpb
from continuum.transcript.v1 import transcript_service_pb2 as tapi
from continuum_handoff_read.reference import entry_tokens
from continuum_runtime.wire_names import HANDOFF_READ_TOOL

NOT_BOUND = (grpc.StatusCode.FAILED_PRECONDITION, "HANDOFF_NOT_BOUND")
DAMAGED = (grpc.StatusCode.FAILED_PRECONDITION, "HANDOFF_PACKAGE_DAMAGED")


@pytest.fixture
async def stack(tmp_path: Path, database_url: str) -> AsyncIterator[HandoffStack]:
    async with running_handoff(tmp_path, database_url) as started:
        yield started


async def test_a_run_of_the_merged_session_is_bound_and_every_other_run_is_refused(stack: HandoffStack) -> None:
    # Merge answers the binding of its target to its owner only.
    binding = await stack.merge.stub.GetHandoffBinding(
        mapi.GetHandoffBindingRequest(target_session_id=stack.target), metadata=stack.user()
    )
    ready = (stack.package_dir / "handoff" / "ready.json").read_bytes()
    assert (binding.operation_id, binding.protocol_version, binding.status) == (
        stack.operation_id,
        2,
        mpb.MERGE_STATUS_COMPLETED,
    )
    assert (binding.target_session_id, binding.handoff_hash) == (stack.target, hashlib.sha256(ready).hexdigest())
    await refused(
        stack.merge.stub.GetHandoffBinding(
            mapi.GetHandoffBindingRequest(target_session_id=stack.target), metadata=stack.user(OTHER)
        ),
        grpc.StatusCode.PERMISSION_DENIED,
        "MERGE_PERMISSION_DENIED",
    )

    # The merged session's run is bound: the package's directory is read (both sources listed).
    await stack.run(stack.target, "run-merged")
    listed = await stack.execute("run-merged")
    assert listed.package_version
    assert {entry.kind for entry in listed.entries} >= {"source"}
    assert len([entry for entry in listed.entries if entry.kind == "source"]) == 2

    # A search through the service, its pages spread over the scanner processes it started.
    found = await stack.execute("run-merged", arguments_json='{"action": "search", "query": "GET /v1/items"}')
    assert found.complete
    texts = [entry.text for entry in found.entries if entry.kind == "part"]
    assert len(texts) == 2
    for source in ("a", "b"):
        assert any(f"{source}: GET /v1/items answers 200" in text for text in texts)

    # An ordinary session's run: no binding.
    await stack.run("a", "run-ordinary")
    await refused(stack.execute("run-ordinary"), *NOT_BOUND)
    # A run that does not exist, and another user's run: transcript's own refusal, relayed.
    details, _ = await refused(stack.execute("run-nobody"), grpc.StatusCode.NOT_FOUND, "RUN_NOT_FOUND")
    assert details.domain == "transcript.continuum"
    await refused(stack.execute("run-merged", owner=OTHER), grpc.StatusCode.NOT_FOUND, "RUN_NOT_FOUND")
    # The merged session read by another user: refused as another user's.
    await refused(stack.reference(owner=OTHER), grpc.StatusCode.PERMISSION_DENIED, "HANDOFF_PERMISSION_DENIED")


async def test_the_reference_entry_names_the_tool_the_package_and_the_sources_within_its_budget(
    stack: HandoffStack,
) -> None:
    ready = (stack.package_dir / "handoff" / "ready.json").read_bytes()

    answer = await stack.reference(max_tokens=2048)

    assert answer.package_version == hashlib.sha256(ready).hexdigest()
    assert answer.tool.name == HANDOFF_READ_TOOL == "HandoffRead"
    assert json.loads(answer.tool.parameters_json_schema)["properties"]["action"]["enum"] == [
        "list",
        "search",
        "read",
        "asset",
    ]
    text = answer.reference_text
    assert answer.estimated_tokens == entry_tokens(text) <= 2048
    assert f"package {answer.package_version[:16]}" in text
    assert "sources: a, b" in text
    assert "A test that passed in the history is not a current pass." in text
    assert "- [" in text  # at least one brief item fits a 2048-token entry
    # A smaller budget keeps the navigation and counts what it leaves out.
    small = await stack.reference(max_tokens=entry_tokens(text) - 1)
    assert small.estimated_tokens < answer.estimated_tokens
    assert small.items_not_expanded > answer.items_not_expanded
    assert f"{small.items_not_expanded} more items not expanded" in small.reference_text
    # Too small even for the navigation: refused with its own reason (compaction's capacity error).
    details, _ = await refused(
        stack.reference(max_tokens=10), grpc.StatusCode.RESOURCE_EXHAUSTED, "HANDOFF_ENTRY_DOES_NOT_FIT"
    )
    assert "minimal entry" in details.message


async def test_a_damaged_package_or_a_deleted_target_is_refused_before_anything_is_read(stack: HandoffStack) -> None:
    await stack.run(stack.target, "run-merged")
    ready = stack.package_dir / "handoff" / "ready.json"
    original = ready.read_bytes()

    # One byte more: the hash no longer matches the operation's.
    ready.write_bytes(original + b" ")
    await refused(stack.execute("run-merged"), *DAMAGED)
    await refused(stack.reference(), *DAMAGED)
    # The same bytes behind a symlink are not read.
    ready.unlink()
    (stack.package_dir / "elsewhere.json").write_bytes(original)
    os.symlink(stack.package_dir / "elsewhere.json", ready)
    await refused(stack.execute("run-merged"), *DAMAGED)
    # A fifo in its place is not opened for reading (that would wait for a writer forever).
    ready.unlink()
    os.mkfifo(ready)
    await refused(stack.execute("run-merged"), *DAMAGED)
    # A brief that no longer matches ready.json: the entry is refused, not built from it.
    ready.unlink()
    ready.write_bytes(original)
    assert (await stack.execute("run-merged")).entries
    brief = stack.package_dir / "handoff" / "brief.json"
    brief.write_bytes(brief.read_bytes().replace(b"{", b"{ ", 1))
    await refused(stack.reference(), *DAMAGED)

    # The merged session deleted: no binding any more (the run's claim went with it).
    await stack.merge.transcript.stub.DeleteSession(
        tapi.DeleteSessionRequest(session_id=stack.target), metadata=stack.user()
    )
    await refused(stack.reference(), *NOT_BOUND)


async def test_malformed_requests_name_their_field(stack: HandoffStack) -> None:
    cases = [
        (stack.execute(""), "run_id"),
        (stack.execute("run", arguments_json=""), "arguments_json"),
        (stack.execute("run", arguments_json="x" * 8193), "arguments_json"),
        (stack.reference(max_tokens=0), "max_tokens"),
        (stack.reference(max_tokens=32 * 1024 + 1), "max_tokens"),
    ]
    for call, field in cases:
        details, _ = await refused(call, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")
        assert [violation.field for violation in details.violations] == [field]
    bad_ids = [
        (api.GetHandoffReferenceRequest(session_id="../a", merge_operation_id=stack.operation_id), "session_id"),
        (api.GetHandoffReferenceRequest(session_id=stack.target, merge_operation_id="x"), "merge_operation_id"),
    ]
    for request, field in bad_ids:
        for budget in (1, 2048):
            request.max_tokens = budget
            details, _ = await refused(
                stack.stub.GetHandoffReference(request, metadata=stack.user()),
                grpc.StatusCode.INVALID_ARGUMENT,
                "INVALID_ARGUMENT",
            )
            assert [violation.field for violation in details.violations] == [field]


async def test_a_binding_that_merge_no_longer_vouches_for_is_not_bound(stack: HandoffStack) -> None:
    # The session's metadata names its operation; another operation id is no binding of it.
    request = api.GetHandoffReferenceRequest(session_id=stack.target, merge_operation_id="0" * 32, max_tokens=2048)
    await refused(stack.stub.GetHandoffReference(request, metadata=stack.user()), *NOT_BOUND)
    # Merge: an unknown target, and a malformed one.
    await refused(
        stack.merge.stub.GetHandoffBinding(
            mapi.GetHandoffBindingRequest(target_session_id="nobody"), metadata=stack.user()
        ),
        grpc.StatusCode.NOT_FOUND,
        "MERGE_OPERATION_NOT_FOUND",
    )
    details, _ = await refused(
        stack.merge.stub.GetHandoffBinding(
            mapi.GetHandoffBindingRequest(target_session_id="../x"), metadata=stack.user()
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_ARGUMENT",
    )
    assert [violation.field for violation in details.violations] == ["target_session_id"]
    # An operation that is not (or no longer) completed binds nothing, even with its target in place.
    async with stack.merge.database.transaction() as connection:
        await connection.execute(
            text("UPDATE session_merges SET status = 'cancelled' WHERE operation_id = :o"), {"o": stack.operation_id}
        )
    await stack.run(stack.target, "run-merged")
    await refused(stack.execute("run-merged"), *NOT_BOUND)
    await refused(stack.reference(), *NOT_BOUND)


async def test_a_call_that_cannot_finish_within_its_deadline_says_so(stack: HandoffStack, tmp_path: Path) -> None:
    await stack.run(stack.target, "run-merged")
    async with running_handoff_read(tmp_path, stack.merge, call_deadline_seconds=0.000_001) as (stub, _, _):
        request = api.ExecuteHandoffReadRequest(run_id="run-merged", arguments_json='{"action": "list"}')
        await refused(
            stub.ExecuteHandoffRead(request, metadata=stack.user()),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "HANDOFF_READ_BUDGET_EXCEEDED",
        )
