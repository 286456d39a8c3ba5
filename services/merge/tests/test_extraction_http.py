"""Extraction through the real HTTP model client against a scripted OpenAI-compatible server on loopback."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from clock_testing import ManualClock
from deadline_testing import eventually
from extraction_testing import SnapshotBuilder
from model_server_testing import MODEL, FakeModelServer, Reply, completion, json_reply

from continuum_merge.extraction import (
    AnswerInvalid,
    CallPolicy,
    CallRecord,
    UnitBudget,
    UnitSpec,
    UnitTooLarge,
    aggregate,
    plan_units,
    run_unit,
    split_unit,
    verify_handoff,
)
from continuum_runtime.provider import (
    ITEMS_PROTOCOL,
    OpenAICompatibleProvider,
    ProviderAuthFailed,
    ProviderInputTooLarge,
    ProviderOutputTruncated,
    ProviderRateLimited,
    ProviderSettings,
    ProviderUnavailable,
    Usage,
)

SECRET_TEXT = "PRIVATE: the user's unreleased plan"


@pytest.fixture
async def server() -> AsyncIterator[FakeModelServer]:
    fake = FakeModelServer()
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()


@pytest.fixture
async def provider(server: FakeModelServer) -> AsyncIterator[OpenAICompatibleProvider]:
    client = OpenAICompatibleProvider(ProviderSettings(kind="openai", base_url=server.url, model=MODEL, max_retries=0))
    try:
        yield client
    finally:
        await client.aclose()


def one_unit(package_dir: Path) -> tuple[Path, UnitSpec]:
    builder = SnapshotBuilder(package_dir)
    builder.add("session-a", 1, "user", "Rename name to displayName in the users response.")
    builder.add("session-a", 2, "assistant", f"Done in api/users.py. {SECRET_TEXT}")
    builder.add("session-b", 1, "assistant", "The header still reads user.name; integration is open.")
    package = builder.seal()
    (unit,) = list(plan_units(package, processor_version="p1", budget=UnitBudget()))
    return package, unit


def answer(*items: dict[str, Any]) -> str:
    return json.dumps({"schemaVersion": 2, "items": list(items)})


RENAMED = {
    "section": "changes",
    "status": "completed",
    "content": "A renamed name to displayName.",
    "evidence": ["i1", "i2"],
}
OPEN = {"section": "conflicts_todos", "status": "pending", "content": "B still reads name.", "evidence": ["i3"]}


async def test_a_valid_answer_becomes_the_unit_result_with_reported_usage(
    tmp_path: Path, server: FakeModelServer, provider: OpenAICompatibleProvider
) -> None:
    package, unit = one_unit(tmp_path)
    server.script(completion(answer(RENAMED, OPEN), usage={"prompt_tokens": 900, "completion_tokens": 13_370}))
    outcome = await run_unit(unit, package, provider, model=MODEL)
    assert outcome.usage == Usage(prompt_tokens=900, completion_tokens=13_370)
    assert outcome.model == f"{MODEL}-2024"
    result = json.loads(outcome.path.read_bytes())
    assert [item["content"] for item in result["items"]] == [RENAMED["content"], OPEN["content"]]
    assert [len(item["evidence"]) for item in result["items"]] == [2, 1]
    assert result["items"][1]["evidence"][0]["sessionId"] == "session-b"
    assert result["requestedModel"] == MODEL
    (request,) = server.requests
    body = request.json()
    system, user = body["messages"]
    assert system["content"].startswith(ITEMS_PROTOCOL + " ")
    inputs = json.loads(user["content"])["inputs"]
    assert [entry["alias"] for entry in inputs] == ["i1", "i2", "i3"]
    assert SECRET_TEXT in inputs[1]["text"]
    assert body["max_tokens"] == UnitBudget().output_tokens


def recorded_failure_answer() -> str:
    """SYNTHETIC rebuild of the recorded failure (seed 000 §2.1): a complete, valid Chinese answer of
    exactly 4,183 bytes, which the old rules refused because the provider reported 13,370 output tokens.
    """
    items = [
        {
            "section": "changes",
            "status": "completed",
            "content": "来源 A 已将用户接口返回字段 name 改名为 displayName。并记录了验证命令。" * 8,
            "evidence": ["i1", "i2"],
        },
        {
            "section": "conflicts_todos",
            "status": "pending",
            "content": "来源 B 的前端仍读取 name。联调事项尚未完成。需要复测。" * 8,
            "evidence": ["i3"],
        },
    ]
    text = answer(*items)
    # Pad the last item's content with ASCII so the whole answer is exactly 4,183 bytes.
    items[1]["content"] = str(items[1]["content"]) + "." * (4_183 - len(text.encode()))
    text = answer(*items)
    assert len(text.encode()) == 4_183
    return text


@pytest.mark.parametrize("usage", [{"prompt_tokens": 3_000, "completion_tokens": 13_370}, None])
async def test_the_recorded_failure_synthetic_a_long_valid_answer_is_kept_with_or_without_usage(
    tmp_path: Path, server: FakeModelServer, provider: OpenAICompatibleProvider, usage: dict[str, int] | None
) -> None:
    package, unit = one_unit(tmp_path)
    server.script(completion(recorded_failure_answer(), usage=usage))
    outcome = await run_unit(unit, package, provider, model=MODEL)
    assert outcome.item_count == 2
    # Reported usage (reasoning included) is recorded as reported and never read as visible output size.
    assert outcome.usage == (Usage(prompt_tokens=3_000, completion_tokens=13_370) if usage else None)
    assert outcome.calls[0].usage.reported is (usage is not None)


async def test_bad_json_gets_one_repair_request_naming_the_problem(
    tmp_path: Path, server: FakeModelServer, provider: OpenAICompatibleProvider
) -> None:
    package, unit = one_unit(tmp_path)
    server.script(
        completion('{"schemaVersion": 2, "items": [{"section": "changes"'),
        completion("```json\n" + answer(OPEN) + "\n```", usage={"prompt_tokens": 5, "completion_tokens": 7}),
    )
    outcome = await run_unit(unit, package, provider, model=MODEL)
    assert len(server.requests) == 2 and len(outcome.calls) == 2
    # The first answer reported no usage: the unit's total is unknown, not the second call's alone.
    assert outcome.usage is None
    assert outcome.calls[1].usage == Usage(prompt_tokens=5, completion_tokens=7)
    repair = json.loads(server.requests[1].json()["messages"][1]["content"])
    assert "not one complete JSON object" in repair["previousAnswerRejected"]
    assert outcome.item_count == 1


async def test_an_answer_citing_unknown_aliases_twice_fails_the_unit_without_a_result(
    tmp_path: Path, server: FakeModelServer, provider: OpenAICompatibleProvider, caplog: pytest.LogCaptureFixture
) -> None:
    package, unit = one_unit(tmp_path)
    invented = dict(OPEN, evidence=["i9"])
    server.script(
        completion(answer(invented), usage={"prompt_tokens": 10, "completion_tokens": 20}),
        completion(answer(RENAMED, dict(OPEN, status="done"))),
    )
    heard: list[tuple[str, CallRecord]] = []
    with pytest.raises(AnswerInvalid, match="status must be one of") as raised:
        await run_unit(
            unit, package, provider, model=MODEL, on_call=lambda subject, call: heard.append((subject, call))
        )
    assert raised.value.unit_id == unit.unit_id
    # Both calls are accounted for, though the unit failed; the second's usage stays unknown.
    assert [(subject, call.usage) for subject, call in heard] == [
        (unit.unit_id, Usage(prompt_tokens=10, completion_tokens=20)),
        (unit.unit_id, Usage()),
    ]
    repair = json.loads(server.requests[1].json()["messages"][1]["content"])
    assert "cites 1 alias(es) this request did not give: i9" in repair["previousAnswerRejected"]
    assert not (package / "work").exists()
    # Logs name the problem, never the history or the answer.
    assert SECRET_TEXT not in caplog.text and "B still reads" not in caplog.text


async def test_a_cancelled_model_call_leaves_no_result(
    tmp_path: Path, server: FakeModelServer, provider: OpenAICompatibleProvider
) -> None:
    """A graceful stop cancels the unit in its model call: nothing is written, the unit is simply redone."""
    package, unit = one_unit(tmp_path)
    server.script(Reply(status=200, body=completion(answer(OPEN)).body, delay_seconds=60))
    running = asyncio.create_task(run_unit(unit, package, provider, model=MODEL))
    await eventually(lambda: server.requests, what="the unit's request to reach the model server")
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert not (package / "work").exists()


async def test_a_truncated_answer_is_never_a_result(
    tmp_path: Path, server: FakeModelServer, provider: OpenAICompatibleProvider
) -> None:
    package, unit = one_unit(tmp_path)
    server.script(
        completion(answer(RENAMED)[:40], finish_reason="length", usage={"prompt_tokens": 9, "completion_tokens": 2048})
    )
    heard: list[tuple[str, CallRecord]] = []
    with pytest.raises(ProviderOutputTruncated):
        await run_unit(unit, package, provider, model=MODEL, on_call=lambda *call: heard.append(call))
    assert not (package / "work").exists()
    # Never used, but paid for: the call is accounted.
    assert heard == [(unit.unit_id, CallRecord(MODEL, Usage(prompt_tokens=9, completion_tokens=2048), "length"))]


async def test_a_refused_or_oversized_request_splits_the_unit_into_halves_that_complete(
    tmp_path: Path, server: FakeModelServer, provider: OpenAICompatibleProvider
) -> None:
    package, unit = one_unit(tmp_path)
    server.script(json_reply({"error": {"code": "context_length_exceeded", "message": "too long"}}, status=400))
    with pytest.raises(ProviderInputTooLarge):
        await run_unit(unit, package, provider, model=MODEL)
    halves = split_unit(package, unit, floor_tokens=0)
    assert halves is not None
    first, second = halves
    # An answer over the response guard is never used, however valid.
    server.script(completion(answer(dict(RENAMED, content="x" * 400))))
    with pytest.raises(UnitTooLarge, match="answer of"):
        await run_unit(first, package, provider, model=MODEL, budget=UnitBudget(response_bytes=300))
    # A request over the request guard is not sent at all.
    sent = len(server.requests)
    with pytest.raises(UnitTooLarge, match="request of"):
        await run_unit(first, package, provider, model=MODEL, budget=UnitBudget(request_bytes=100))
    assert len(server.requests) == sent
    assert not (package / "work").exists()
    server.script(completion(answer(dict(RENAMED, evidence=["i1"]))), completion(answer(dict(OPEN, evidence=["i2"]))))
    outcomes = [await run_unit(half, package, provider, model=MODEL) for half in (first, second)]
    assert [outcome.relative_path for outcome in outcomes] == [f"work/{unit.unit_id}.{n}.json" for n in (0, 1)]
    second_result = json.loads(outcomes[1].path.read_bytes())
    assert [e["sessionId"] for e in second_result["items"][0]["evidence"]] == ["session-b"]


async def test_aggregation_condenses_through_the_http_client(
    tmp_path: Path, server: FakeModelServer, provider: OpenAICompatibleProvider
) -> None:
    package, unit = one_unit(tmp_path)
    server.script(completion(answer(RENAMED, OPEN)))
    outcome = await run_unit(unit, package, provider, model=MODEL)
    condensed = {
        "section": "conflicts_todos",
        "status": "conflict",
        "content": "A renamed it; B reads old.",
        "evidence": ["a1", "a2"],
    }
    server.script(completion(answer(condensed), usage={"prompt_tokens": 50, "completion_tokens": 20}))
    heard: list[tuple[str, CallRecord]] = []
    ready = await aggregate(
        package, [outcome.path], provider, model=MODEL, brief_tokens=10, on_call=lambda *call: heard.append(call)
    )
    assert [call.usage for _, call in heard] == [Usage(prompt_tokens=50, completion_tokens=20)]
    assert (ready.layer_count, ready.brief_item_count, ready.navigation, ready.not_expanded) == (1, 1, False, 0)
    brief = json.loads((package / "handoff" / "brief.json").read_bytes())
    result = json.loads(outcome.path.read_bytes())
    assert brief["items"][0]["evidence"] == [item["itemId"] for item in result["items"]]
    condense_inputs = json.loads(server.requests[1].json()["messages"][1]["content"])["inputs"]
    assert [entry["alias"] for entry in condense_inputs] == ["a1", "a2"]
    assert verify_handoff(package) == ready
    # Aggregating again (after a crash) reuses the packs already answered.
    assert await aggregate(package, [outcome.path], provider, model=MODEL, brief_tokens=10) == ready
    assert len(server.requests) == 2


class RecordingClock(ManualClock):
    """A clock whose backoff waits end at once but are recorded; the per-call timer (300 s) never fires."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    async def sleep(self, seconds: float) -> None:
        if seconds >= CallPolicy().timeout_seconds:
            await super().sleep(seconds)
            return
        self.waits.append(seconds)
        await asyncio.sleep(0)


async def test_transient_failures_are_retried_after_2_then_5_seconds_on_the_injected_clock(
    tmp_path: Path, server: FakeModelServer, provider: OpenAICompatibleProvider
) -> None:
    package, unit = one_unit(tmp_path)
    clock = RecordingClock()
    server.script(Reply(status=503, body=b"{}"), Reply(status=502, body=b"{}"), completion(answer(OPEN)))
    outcome = await run_unit(unit, package, provider, model=MODEL, policy=CallPolicy(clock=clock))
    assert outcome.item_count == 1 and len(server.requests) == 3
    assert clock.waits == [2.0, 5.0]


async def test_retry_after_is_followed_and_the_third_failure_propagates(
    tmp_path: Path, server: FakeModelServer, provider: OpenAICompatibleProvider
) -> None:
    package, unit = one_unit(tmp_path)
    clock = RecordingClock()
    limited = Reply(status=429, body=b"{}", headers=(("Retry-After", "7"),))
    server.script(limited, limited, limited)
    with pytest.raises(ProviderRateLimited):
        await run_unit(unit, package, provider, model=MODEL, policy=CallPolicy(clock=clock))
    assert clock.waits == [7.0, 7.0] and len(server.requests) == 3


async def test_credentials_refused_are_not_retried(
    tmp_path: Path, server: FakeModelServer, provider: OpenAICompatibleProvider
) -> None:
    package, unit = one_unit(tmp_path)
    clock = RecordingClock()
    server.script(json_reply({"error": {"code": "invalid_api_key"}}, status=401))
    with pytest.raises(ProviderAuthFailed):
        await run_unit(unit, package, provider, model=MODEL, policy=CallPolicy(clock=clock))
    assert clock.waits == [] and len(server.requests) == 1


async def test_a_call_over_its_timeout_is_cancelled_on_the_injected_clock(
    tmp_path: Path, server: FakeModelServer, provider: OpenAICompatibleProvider
) -> None:
    package, unit = one_unit(tmp_path)
    clock = ManualClock()
    server.script(Reply(status=200, body=completion(answer(OPEN)).body, delay_seconds=60))
    running = asyncio.create_task(
        run_unit(unit, package, provider, model=MODEL, policy=CallPolicy(attempts=1, clock=clock))
    )
    await eventually(lambda: server.requests and clock.sleepers == 1, what="the call and its timer")
    clock.advance(299)
    await asyncio.sleep(0)
    assert not running.done()
    clock.advance(1)
    with pytest.raises(ProviderUnavailable, match="timed out after 300 s"):
        await running
    assert not (package / "work").exists()


async def test_a_condensing_pack_that_does_not_fit_is_bisected(
    tmp_path: Path, server: FakeModelServer, provider: OpenAICompatibleProvider
) -> None:
    package, unit = one_unit(tmp_path)
    server.script(completion(answer(RENAMED, OPEN)))
    outcome = await run_unit(unit, package, provider, model=MODEL)
    condensed = {"section": "changes", "status": "completed", "content": "c", "evidence": ["a1"]}
    server.script(
        json_reply({"error": {"message": "too large"}}, status=413),
        completion(answer(condensed)),
        completion(answer(condensed)),
    )
    ready = await aggregate(package, [outcome.path], provider, model=MODEL, brief_tokens=10)
    assert (ready.layer_count, ready.brief_item_count, ready.not_expanded) == (1, 2, 0)
    halves = [json.loads(request.json()["messages"][1]["content"])["inputs"] for request in server.requests[2:]]
    assert [[entry["alias"] for entry in inputs] for inputs in halves] == [["a1"], ["a1"]]
    # A pack of one item that still does not fit cannot shrink further: the error reaches the stage.
    (package / "handoff").rename(package / "handoff.before")
    server.script(completion(answer(OPEN)))
    one_item = await run_unit(unit, package, provider, model=MODEL)
    server.script(json_reply({"error": {"message": "too large"}}, status=413))
    with pytest.raises(ProviderInputTooLarge):
        await aggregate(package, [one_item.path], provider, model=MODEL, brief_tokens=1)
