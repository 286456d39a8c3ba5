"""The fault table of seed 000 §6.3, each row driven end to end: transcript and merge servers on each
backend, the real stages and worker, and the real HTTP model client against a scripted model server on
loopback. What is asserted is what the operation and its unit rows show, and what the server received."""

from __future__ import annotations

import itertools
import json
import logging
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from deadline_testing import eventually
from merge_testing import MergeStack, running_merge
from model_server_testing import MODEL, FakeModelServer, Reply, completion, json_reply
from sqlalchemy import select
from transcript_testing import append, user

from continuum.merge.v1 import error_code_pb2
from continuum.merge.v1 import merge_service_pb2 as api
from continuum.merge.v1 import resources_pb2 as pb
from continuum_merge.extraction import ExtractionSettings
from continuum_merge.tables import session_merge_attempts, session_merge_units
from continuum_runtime.provider import ProviderSettings

SECRET = "PRIVATE-HISTORY-TEXT"
# Parts big enough that a unit of two is above the 256-token shrink floor, and one alone is not split.
PART_TEXT = SECRET + " " + "the users endpoint now returns displayName instead of name; " * 9


@pytest.fixture
async def model() -> AsyncIterator[FakeModelServer]:
    server = FakeModelServer()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def stack(tmp_path: Path, database_url: str, model: FakeModelServer) -> AsyncIterator[MergeStack]:
    overrides: dict[str, object] = {
        "lease_ttl_seconds": 2.0,
        "lease_renew_seconds": 0.3,
        "worker_poll_seconds": 0.1,
        "claim_ttl_seconds": 5.0,
        "claim_renew_seconds": 1.0,
        "retry_seconds": 0.2,
        "provider": ProviderSettings(kind="openai", base_url=model.url, model=MODEL),
        # No waiting between attempts in tests (the 2 s / 5 s defaults are tested on their own).
        "extraction": ExtractionSettings(backoff_seconds=(0.0,), response_bytes=4096),
    }
    async with running_merge(tmp_path, database_url, overrides=overrides) as started:
        yield started


def answer(*aliases: str, content: str = "A renamed name to displayName.") -> Reply:
    items = [
        {"section": "changes", "status": "completed", "content": content, "evidence": [alias]} for alias in aliases
    ]
    return completion(
        json.dumps({"schemaVersion": 2, "items": items}), usage={"prompt_tokens": 9, "completion_tokens": 9}
    )


async def one_source(stack: MergeStack, parts: int = 2) -> str:
    """Source "a" with `parts` user messages of one text part each, and "b" with none; the merge's id."""
    await stack.new_session("b", texts=0)
    await stack.new_session("a", texts=0)
    for index in range(parts):
        await append(stack.transcript, "a", user(f"{index}: {PART_TEXT}"))
    start = await stack.start(["a", "b"], title="Merged")
    operation_id: str = start.operation.progress.operation_id
    return operation_id


async def settled(stack: MergeStack, operation_id: str) -> pb.MergeOperation:
    """The operation once it is completed or paused."""

    async def done() -> bool:
        status = (await stack.get(operation_id)).progress.status
        return status in (pb.MERGE_STATUS_COMPLETED, pb.MERGE_STATUS_PAUSED)

    await eventually(done, what="the merge to complete or pause", seconds=60)
    return await stack.get(operation_id)


async def units(stack: MergeStack, operation_id: str) -> dict[str, dict[str, Any]]:
    """Unit rows by id, with their attempts' outcomes."""
    table, attempts = session_merge_units, session_merge_attempts
    async with stack.database.connection() as connection:
        rows = (await connection.execute(select(table).where(table.c.operation_id == operation_id))).mappings().all()
        tries = (
            (await connection.execute(select(attempts).where(attempts.c.operation_id == operation_id))).mappings().all()
        )
    found = {row["unit_id"]: dict(row) | {"outcomes": Counter()} for row in rows}
    for attempt in tries:
        found[attempt["unit_id"]]["outcomes"][attempt["outcome"]] += 1
    return found


async def resume(stack: MergeStack, operation: pb.MergeOperation, model: str = "") -> None:
    await stack.stub.ResumeMerge(
        api.ResumeMergeRequest(
            operation_id=operation.progress.operation_id, expected_epoch=operation.progress.run_epoch, model=model
        ),
        metadata=stack.user(),
    )


def children_of(row: dict[str, Any]) -> list[str]:
    children: list[str] = json.loads(row["input_json"])["childUnitIds"]
    return children


def assert_logs_name_the_call_but_hold_no_history(caplog: pytest.LogCaptureFixture, operation_id: str) -> None:
    """The extraction's records name the operation, the unit, the model and the budget figures; no record
    (message or fields) holds the history."""
    accepted = [record for record in caplog.records if record.getMessage() == "structured answer accepted"]
    assert accepted and all(getattr(record, "operation_id", None) == operation_id for record in accepted)
    assert all(
        hasattr(record, field)
        for record in accepted
        for field in ("subject", "model", "material_tokens", "max_output_tokens", "finish_reason", "usage_reported")
    )
    for record in caplog.records:
        shown = record.getMessage() + repr(record.__dict__)
        assert SECRET not in shown and "displayName instead" not in shown


@pytest.mark.parametrize(
    "refusal",
    [
        json_reply({"error": {"message": "too large"}}, status=413),
        json_reply({"error": {"code": "context_length_exceeded", "message": "too long"}}, status=400),
        completion('{"schemaVersion": 2, "items": [{"section": "chan', finish_reason="length"),
        answer("i1", content="x" * 5000),  # complete and valid, but over the 4 KiB response guard
    ],
    ids=["413", "context-refusal", "stop-length", "over-response-guard"],
)
async def test_a_request_or_answer_that_does_not_fit_splits_the_unit_in_the_database_and_completes(
    stack: MergeStack, model: FakeModelServer, refusal: Reply, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="continuum.merge.extraction")
    operation_id = await one_source(stack)
    model.script(refusal, answer("i1"), answer("i1"))
    operation = await settled(stack, operation_id)
    assert operation.progress.status == pb.MERGE_STATUS_COMPLETED, operation
    rows = await units(stack, operation_id)
    (parent,) = [row for row in rows.values() if row["state"] == "split"]
    # The parent stores its children's ids; they were inserted with it and each completed once.
    children = children_of(parent)
    assert children == [f"{parent['unit_id']}.0", f"{parent['unit_id']}.1"]
    assert [rows[child]["state"] for child in children] == ["completed", "completed"]
    assert parent["outcomes"] == Counter({"error": 1})
    assert [rows[child]["outcomes"] for child in children] == [Counter({"completed": 1})] * 2
    # Each half carried one part: the truncated or oversized answer was never a result.
    halves = [json.loads(request.json()["messages"][1]["content"])["inputs"] for request in model.requests[1:]]
    assert [len(inputs) for inputs in halves] == [1, 1]
    assert_logs_name_the_call_but_hold_no_history(caplog, operation_id)


async def test_bad_json_gets_one_repair_then_the_unit_is_split(stack: MergeStack, model: FakeModelServer) -> None:
    operation_id = await one_source(stack)
    model.script(completion("not json"), completion('{"schemaVersion": 2, "items": [{"evidence": ["i7"]}]}'))
    model.script(answer("i1"), answer("i1"))
    operation = await settled(stack, operation_id)
    assert operation.progress.status == pb.MERGE_STATUS_COMPLETED, operation
    repair = json.loads(model.requests[1].json()["messages"][1]["content"])
    assert "not one complete JSON object" in repair["previousAnswerRejected"]
    rows = await units(stack, operation_id)
    assert sorted(row["state"] for row in rows.values()) == ["completed", "completed", "split"]


async def test_at_the_shrink_floor_the_operation_pauses_and_resuming_with_another_model_redoes_only_the_rest(
    stack: MergeStack, model: FakeModelServer
) -> None:
    operation_id = await one_source(stack)
    too_large = json_reply({"error": {"message": "too large"}}, status=413)
    # The unit splits into single parts; the first part alone is still refused: it cannot shrink further.
    model.script(too_large, too_large)
    paused = await settled(stack, operation_id)
    assert paused.progress.status == pb.MERGE_STATUS_PAUSED
    assert paused.progress.error_code == error_code_pb2.PROVIDER_UNAVAILABLE
    assert "shrink floor" in paused.progress.error
    before = await units(stack, operation_id)
    # The split is kept; neither half has a result (the refused one is reset to pending by the next run).
    assert sorted(row["state"] for row in before.values()) == ["pending", "running", "split"]

    model.script(answer("i1"), answer("i1"))
    await resume(stack, paused, model="another-model")
    operation = await settled(stack, operation_id)
    assert operation.progress.status == pb.MERGE_STATUS_COMPLETED, operation
    after = await units(stack, operation_id)
    (parent,) = [row for row in after.values() if row["state"] == "split"]
    # The parent was not asked again; each half ran once more (the first after its refusal).
    assert parent["outcomes"] == Counter({"error": 1})
    first, second = children_of(parent)
    assert after[first]["outcomes"] == Counter({"error": 1, "completed": 1})
    assert after[second]["outcomes"] == Counter({"completed": 1})
    assert after[first]["model"] == "another-model"
    assert [request.json()["model"] for request in model.requests] == [MODEL] * 4


@pytest.mark.parametrize(
    "failure",
    [
        Reply(status=503, body=b"{}"),
        Reply(status=429, body=b"{}", headers=(("Retry-After", "0"),)),
        Reply(status=200, body=b"<html>gateway</html>"),
    ],
    ids=["5xx", "429", "not-a-completion"],
)
async def test_transient_failures_are_tried_three_times_then_pause_resumably(
    stack: MergeStack, model: FakeModelServer, failure: Reply
) -> None:
    operation_id = await one_source(stack)
    model.script(failure, failure, failure)
    paused = await settled(stack, operation_id)
    assert paused.progress.status == pb.MERGE_STATUS_PAUSED
    assert paused.progress.error_code == error_code_pb2.PROVIDER_UNAVAILABLE
    assert len(model.requests) == 3
    model.script(failure, answer("i1"))
    await resume(stack, paused)
    operation = await settled(stack, operation_id)
    assert operation.progress.status == pb.MERGE_STATUS_COMPLETED, operation
    assert len(model.requests) == 5


@pytest.mark.parametrize(
    "refusal",
    [
        json_reply({"error": {"code": "invalid_api_key"}}, status=401),
        json_reply({"error": {"code": "model_not_found"}}, status=404),
    ],
    ids=["credentials", "unknown-model"],
)
async def test_refused_credentials_or_model_configuration_pause_at_once(
    stack: MergeStack, model: FakeModelServer, refusal: Reply
) -> None:
    operation_id = await one_source(stack)
    model.script(refusal)
    paused = await settled(stack, operation_id)
    assert paused.progress.status == pb.MERGE_STATUS_PAUSED and paused.progress.can_resume
    assert paused.progress.error_code == error_code_pb2.PROVIDER_UNAVAILABLE
    assert "check its credentials and model" in paused.progress.error
    assert len(model.requests) == 1


@pytest.mark.parametrize("status", [402, 429], ids=["payment-required", "openai-insufficient-quota"])
async def test_an_exhausted_spending_quota_pauses_at_once_saying_how_to_resume(
    stack: MergeStack, model: FakeModelServer, status: int
) -> None:
    # OpenAI answers a spent quota with 429 insufficient_quota: not a rate limit, so not retried.
    operation_id = await one_source(stack)
    model.script(json_reply({"error": {"code": "insufficient_quota", "type": "insufficient_quota"}}, status=status))
    paused = await settled(stack, operation_id)
    assert paused.progress.status == pb.MERGE_STATUS_PAUSED and paused.progress.can_resume
    assert paused.progress.error_code == error_code_pb2.PROVIDER_UNAVAILABLE
    assert "quota is raised" in paused.progress.error
    assert len(model.requests) == 1
    model.script(answer("i1"))
    await resume(stack, paused)
    assert (await settled(stack, operation_id)).progress.status == pb.MERGE_STATUS_COMPLETED


async def test_a_failure_at_unit_n_keeps_units_1_to_n_minus_1(stack: MergeStack, model: FakeModelServer) -> None:
    operation_id = await one_source(stack, parts=100)
    # Unit 1 completes, unit 2 meets refused credentials.
    model.script(answer("i1"), json_reply({"error": {}}, status=401))
    paused = await settled(stack, operation_id)
    assert paused.progress.status == pb.MERGE_STATUS_PAUSED
    rows = await units(stack, operation_id)
    planned = len(rows)
    assert planned > 2
    ordered = sorted(rows.values(), key=lambda row: row["ordinal"])
    # Unit 1's result is kept; unit 2 has none (it goes back to pending when the next run starts).
    assert [row["state"] for row in ordered[:3]] == ["completed", "running", "pending"]
    model.script(*(answer("i1") for _ in range(planned - 1)))
    await resume(stack, paused)
    operation = await settled(stack, operation_id)
    assert operation.progress.status == pb.MERGE_STATUS_COMPLETED, operation
    # Unit 1 was not asked again.
    assert len(model.requests) == 2 + planned - 1


def recorded_failure_answer() -> str:
    """SYNTHETIC rebuild of the recorded failure (seed 000 §2.1), not the real answer (it no longer exists):
    a complete, valid Chinese answer of exactly 4,183 bytes, which the old rules refused against a 3,500
    limit because the provider reported 13,370 output tokens (reasoning included)."""
    item = {"section": "changes", "status": "completed", "evidence": ["i1"]}
    content = "来源 A 已将用户接口返回字段 name 改名为 displayName; 并记录了验证命令与结果。" * 20
    text = json.dumps({"schemaVersion": 2, "items": [item | {"content": content}]}, ensure_ascii=False)
    padded = content + "." * (4_183 - len(text.encode()))
    text = json.dumps({"schemaVersion": 2, "items": [item | {"content": padded}]}, ensure_ascii=False)
    assert len(text.encode()) == 4_183
    return text


@pytest.fixture
async def small_requests(tmp_path: Path, database_url: str, model: FakeModelServer) -> AsyncIterator[MergeStack]:
    """A stack whose requests carry about 1,000 estimated tokens of material, so a short history needs
    more than 16 units (the old implementation's fixed total of 16 calls)."""
    overrides: dict[str, object] = {
        "worker_poll_seconds": 0.1,
        "provider": ProviderSettings(kind="openai", base_url=model.url, model=MODEL),
        # A brief target the details fit in: no condensing requests (this scripted server answers units only).
        "extraction": ExtractionSettings(request_tokens=5_000, context_window_tokens=16_384, brief_tokens=1_000_000),
    }
    async with running_merge(tmp_path, database_url, overrides=overrides) as started:
        yield started


@pytest.mark.parametrize("usage", [{"prompt_tokens": 3_000, "completion_tokens": 13_370}, None], ids=["usage", "none"])
async def test_the_recorded_failure_synthetic_completes_and_publishes_with_more_than_16_units(
    small_requests: MergeStack, model: FakeModelServer, usage: dict[str, int] | None
) -> None:
    stack = small_requests
    operation_id = await one_source(stack, parts=100)
    # Every request gets the long valid answer; the unscripted rest of the run would get 418s.
    model.script(*(completion(recorded_failure_answer(), usage=usage) for _ in range(200)))
    operation = await settled(stack, operation_id)
    assert operation.progress.status == pb.MERGE_STATUS_COMPLETED, operation
    assert operation.progress.target_available
    rows = await units(stack, operation_id)
    assert len(rows) > 16 and {row["state"] for row in rows.values()} == {"completed"}
    async with stack.database.connection() as connection:
        tries = (
            await connection.execute(
                select(session_merge_attempts.c.output_tokens).where(
                    session_merge_attempts.c.operation_id == operation_id
                )
            )
        ).all()
    # Usage is recorded as reported (13,370 each, reasoning included) or stays unknown; never a reason to refuse.
    assert {row.output_tokens for row in tries} == ({13_370} if usage else {None})


async def test_a_single_part_too_large_is_bisected_into_slices_down_to_the_floor(
    stack: MergeStack, model: FakeModelServer
) -> None:
    await stack.new_session("b", texts=0)
    await stack.new_session("a", texts=0)
    long_text = "一二三四五 displayName " * 120  # one part of about 2,900 bytes: about 720 estimated tokens
    await append(stack.transcript, "a", user(long_text))
    operation_id = (await stack.start(["a", "b"], title="Merged")).operation.progress.operation_id
    too_large = json_reply({"error": {"message": "too large"}}, status=413)
    model.script(too_large, answer("i1"), too_large, answer("i1"), answer("i1"))
    operation = await settled(stack, operation_id)
    assert operation.progress.status == pb.MERGE_STATUS_COMPLETED, operation
    rows = await units(stack, operation_id)
    leaves = sorted(row["unit_id"] for row in rows.values() if row["state"] == "completed")
    assert len(leaves) == 3 and len([row for row in rows.values() if row["state"] == "split"]) == 2
    slices = [json.loads(rows[leaf]["input_json"])["slice"] for leaf in leaves]
    package = stack.settings.resolved_package_root() / operation_id
    evidence = [
        json.loads((package / rows[leaf]["result_path"]).read_bytes())["items"][0]["evidence"][0] for leaf in leaves
    ]
    sealed = (package / "snapshot" / "text" / f"{evidence[0]['recordRef']}-0.txt").read_text(encoding="utf-8")
    assert long_text in sealed
    # The slices are contiguous and cover the whole part (bytes cut on code points); each request carried
    # only its slice.
    data = sealed.encode()
    assert slices[0]["bytes"][0] == 0 and slices[-1]["bytes"][1] == len(data)
    assert all(left["bytes"][1] == right["bytes"][0] for left, right in itertools.pairwise(slices))
    sent = [json.loads(request.json()["messages"][1]["content"])["inputs"][0]["text"] for request in model.requests]
    # Requests: whole (refused), first half, second half (refused), its two quarters.
    assert sent[1] + sent[3] + sent[4] == sealed and sent[2] == sent[3] + sent[4]
    # Evidence ranges are UTF-16 ranges of the sealed part, matching each slice (BMP text: one unit each).
    assert [entry["utf16"] for entry in evidence] == [
        [len(data[:start].decode()), len(data[:end].decode())] for start, end in (piece["bytes"] for piece in slices)
    ]


async def test_a_slice_at_the_floor_pauses(stack: MergeStack, model: FakeModelServer) -> None:
    await stack.new_session("b", texts=0)
    await stack.new_session("a", texts=0)
    await append(stack.transcript, "a", user("x" * 1_600))  # 400 estimated tokens: one split, then the floor
    operation_id = (await stack.start(["a", "b"], title="Merged")).operation.progress.operation_id
    too_large = json_reply({"error": {"message": "too large"}}, status=413)
    model.script(too_large, too_large)
    paused = await settled(stack, operation_id)
    assert paused.progress.status == pb.MERGE_STATUS_PAUSED
    assert "shrink floor" in paused.progress.error
    assert len(model.requests) == 2
