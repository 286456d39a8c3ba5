"""Manual compaction (seed 004 §5.4, §7): idle runs under a compaction claim, running queues a signal
bound to the run, a stale signal never fires, disabled auto compaction does not disable manual."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from compaction_testing import (
    RecordingProxy,
    ScriptedProvider,
    Stack,
    eventually,
    running_stack,
    runtime_events,
    summarized_ids,
)
from google.protobuf import duration_pb2
from transcript_testing import Follower, assistant, refused, tool, user

from continuum.compaction.events.v1 import events_pb2
from continuum.compaction.v1 import compaction_service_pb2 as api
from continuum.compaction.v1 import resources_pb2 as pb
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as tapi


async def _history(stack: Stack, turns: int = 3) -> list[int]:
    await stack.new_session("s1")
    ids: list[int] = []
    for index in range(turns):
        ids += await stack.append("s1", user(f"request {index}"), assistant(f"answer {index}"))
    return ids


def _claim(kind: tpb.ClaimKind.ValueType, holder: str) -> tapi.AcquireClaimsRequest:
    return tapi.AcquireClaimsRequest(
        session_ids=["s1"], kind=kind, holder=holder, ttl=duration_pb2.Duration(seconds=60)
    )


async def _compact_now(stack: Stack) -> api.CompactNowResponse:
    response: api.CompactNowResponse = await stack.stub.CompactNow(
        api.CompactNowRequest(session_id="s1"), metadata=stack.user()
    )
    return response


async def _events(stack: Stack) -> list[pb.CompactionEvent]:
    response = await stack.stub.ListCompactionEvents(
        api.ListCompactionEventsRequest(session_id="s1", include_summary_text=True), metadata=stack.user()
    )
    return list(response.events)


async def test_idle_manual_compaction_holds_a_claim_and_bypasses_only_the_threshold(
    tmp_path: Path, database_url: str
) -> None:
    gate = asyncio.Event()
    # The automatic trigger could never hold (ratio 1.0 of a huge window) and is switched off too.
    async with running_stack(
        tmp_path, database_url, ScriptedProvider(gate=gate), trigger_ratio=1.0, auto_compaction=False
    ) as stack:
        ids = await _history(stack)
        compacting = asyncio.create_task(_compact_now(stack))
        await eventually(lambda: stack.provider.waiting == 1)

        # Meanwhile a new turn is refused as if the session were running.
        await refused(
            stack.transcript.stub.AcquireClaims(_claim(tpb.CLAIM_KIND_RUN, "run-9"), metadata=stack.user()),
            grpc.StatusCode.FAILED_PRECONDITION,
            "SESSION_ALREADY_RUNNING",
        )
        # A second click while it runs is answered, not queued twice.
        again = await _compact_now(stack)
        assert again.state == api.COMPACT_NOW_STATE_IN_PROGRESS
        gate.set()
        response = await compacting

        assert response.state == api.COMPACT_NOW_STATE_COMPLETED
        assert response.report.outcome == events_pb2.COMPACTION_OUTCOME_COMPACTED
        assert response.report.trigger_mode == events_pb2.TRIGGER_MODE_MANUAL
        # The last turn stays (recent_turns = 0 in these tests).
        assert response.report.boundary_after == ids[3]
        (event,) = await _events(stack)
        assert event.trigger_mode == events_pb2.TRIGGER_MODE_MANUAL
        assert event.summary_text
        # The claim was released: a turn may start again.
        claim = await stack.transcript.stub.AcquireClaims(_claim(tpb.CLAIM_KIND_RUN, "run-9"), metadata=stack.user())
        assert claim.claim.claim_id


async def test_running_session_queues_a_signal_that_fires_at_the_next_tool_round(
    tmp_path: Path, database_url: str
) -> None:
    async with running_stack(tmp_path, database_url, auto_compaction=False) as stack:
        ids = await _history(stack)
        await stack.transcript.stub.AcquireClaims(_claim(tpb.CLAIM_KIND_RUN, "run-7"), metadata=stack.user())
        current = await stack.append("s1", user("current request"))

        queued = await _compact_now(stack)
        repeated = await _compact_now(stack)

        assert (queued.state, queued.run_id) == (api.COMPACT_NOW_STATE_QUEUED, "run-7")
        assert (repeated.state, repeated.run_id) == (api.COMPACT_NOW_STATE_QUEUED, "run-7")
        assert stack.provider.calls == []
        # The run's first request does not consume it; its first tool-round boundary does.
        start = await stack.build("s1", run_id="run-7")
        assert start.compaction.outcome == events_pb2.COMPACTION_OUTCOME_NOT_TRIGGERED
        round_ = await stack.append("s1", assistant("checking", "c1"), tool("c1", "ok"), assistant("again", "c2"))
        round_ += await stack.append("s1", tool("c2", "ok"))
        mid = await stack.build("s1", run_id="run-7", trigger_point=api.TRIGGER_POINT_MID_LOOP)

        assert mid.compaction.outcome == events_pb2.COMPACTION_OUTCOME_COMPACTED
        assert mid.compaction.trigger_mode == events_pb2.TRIGGER_MODE_MANUAL
        # Mid-loop: the current request and its completed rounds but the latest are summarized.
        assert mid.boundary_message_id == round_[1]
        assert [m.message_id for m in mid.messages[1:]] == round_[2:]
        assert (
            f"User request #{current[0]} (in progress when this summary was written; verbatim):\ncurrent request"
            in (mid.messages[0].content[0].text)
        )
        assert current[0] < mid.boundary_message_id
        # Consumed exactly once.
        later = await stack.build("s1", run_id="run-7", trigger_point=api.TRIGGER_POINT_MID_LOOP)
        assert later.compaction.outcome == events_pb2.COMPACTION_OUTCOME_NOT_TRIGGERED
        # The earlier turns, the request and its completed rounds but the latest, in one summary call.
        assert [summarized_ids(call) for call in stack.provider.summarize_calls()] == [[*ids, *current, *round_[:2]]]


async def test_a_signal_of_a_finished_run_never_fires(tmp_path: Path, database_url: str) -> None:
    async with running_stack(tmp_path, database_url, auto_compaction=False) as stack:
        await _history(stack)
        claim = await stack.transcript.stub.AcquireClaims(_claim(tpb.CLAIM_KIND_RUN, "run-1"), metadata=stack.user())
        assert (await _compact_now(stack)).state == api.COMPACT_NOW_STATE_QUEUED
        # run-1 ends without another tool round; run-2 starts.
        await stack.transcript.stub.ReleaseClaims(
            tapi.ReleaseClaimsRequest(claim_id=claim.claim.claim_id), metadata=stack.user()
        )
        await stack.append("s1", user("next"), assistant("working", "c1"), tool("c1", "ok"))

        await stack.build("s1", run_id="run-2")
        mid = await stack.build("s1", run_id="run-2", trigger_point=api.TRIGGER_POINT_MID_LOOP)

        assert mid.compaction.outcome == events_pb2.COMPACTION_OUTCOME_NOT_TRIGGERED
        assert stack.provider.calls == []


async def test_a_signal_is_dropped_by_a_mid_loop_call_of_another_run(tmp_path: Path, database_url: str) -> None:
    async with running_stack(tmp_path, database_url, auto_compaction=False) as stack:
        await _history(stack)
        await stack.transcript.stub.AcquireClaims(_claim(tpb.CLAIM_KIND_RUN, "run-1"), metadata=stack.user())
        await _compact_now(stack)

        other = await stack.build("s1", run_id="run-2", trigger_point=api.TRIGGER_POINT_MID_LOOP)
        own = await stack.build("s1", run_id="run-1", trigger_point=api.TRIGGER_POINT_MID_LOOP)

        assert other.compaction.outcome == own.compaction.outcome == events_pb2.COMPACTION_OUTCOME_NOT_TRIGGERED
        assert stack.provider.calls == []


async def test_manual_compaction_of_a_merge_held_session_is_refused(stack: Stack) -> None:
    await _history(stack)
    await stack.transcript.stub.AcquireClaims(_claim(tpb.CLAIM_KIND_MERGE, "merge-1"), metadata=stack.user())

    await refused(_compact_now(stack), grpc.StatusCode.FAILED_PRECONDITION, "SESSION_BUSY")


async def test_manual_compaction_with_nothing_to_compact_says_so(stack: Stack) -> None:
    await stack.new_session("s1")
    await stack.append("s1", user("only turn"), assistant("reply"))

    response = await _compact_now(stack)

    assert response.state == api.COMPACT_NOW_STATE_COMPLETED
    assert response.report.outcome == events_pb2.COMPACTION_OUTCOME_NOTHING_TO_COMPACT
    assert stack.provider.calls == []
    assert (await _events(stack))[0].outcome == events_pb2.COMPACTION_OUTCOME_NOTHING_TO_COMPACT


@pytest.mark.parametrize("rpc", ["CompactNow", "GetCompactionSummary", "ListCompactionEvents", "BuildContext"])
async def test_only_the_owner_may_use_a_session(stack: Stack, rpc: str) -> None:
    await _history(stack)
    requests = {
        "CompactNow": api.CompactNowRequest(session_id="s1"),
        "GetCompactionSummary": api.GetCompactionSummaryRequest(session_id="s1"),
        "ListCompactionEvents": api.ListCompactionEventsRequest(session_id="s1"),
        "BuildContext": api.BuildContextRequest(
            session_id="s1", run_id="r", trigger_point=api.TRIGGER_POINT_REQUEST_START
        ),
    }

    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await getattr(stack.stub, rpc)(requests[rpc], metadata=stack.user("mallory"))

    assert raised.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND)
    assert stack.provider.calls == []
    assert await stack.record_rows("s1") == []


async def test_idle_manual_compaction_is_visible_in_follow(stack: Stack) -> None:
    await _history(stack)
    follower = Follower(stack.transcript, "s1")
    await follower.until("snapshot_end")

    response = await _compact_now(stack)

    events = await runtime_events(follower, 4)
    follower.close()
    kinds = ["compaction_started", "compaction_ended", "compaction_marker", "context_window"]
    assert [event.WhichOneof("event") for event in events] == kinds
    started, ended, marker, window = events
    modes = {started.compaction_started.trigger_mode, ended.compaction_ended.trigger_mode}
    assert modes | {marker.compaction_marker.trigger_mode} == {events_pb2.TRIGGER_MODE_MANUAL}
    assert marker.compaction_marker.boundary == response.report.boundary_after
    assert [section.key for section in window.context_window.manifest.sections] == ["summary", "messages"]


async def test_a_queued_signal_survives_a_request_that_failed_before_compacting(
    tmp_path: Path, database_url: str
) -> None:
    proxy = RecordingProxy()
    async with running_stack(tmp_path, database_url, proxy=proxy, auto_compaction=False) as stack:
        await _history(stack)
        await stack.transcript.stub.AcquireClaims(_claim(tpb.CLAIM_KIND_RUN, "run-7"), metadata=stack.user())
        await stack.append("s1", user("current"), assistant("a", "c1"), tool("c1", "ok"), assistant("b", "c2"))
        await stack.append("s1", tool("c2", "ok"))
        assert (await _compact_now(stack)).state == api.COMPACT_NOW_STATE_QUEUED
        proxy.unavailable.add("ListMessagesAfter")

        await refused(
            stack.build("s1", run_id="run-7", trigger_point=api.TRIGGER_POINT_MID_LOOP),
            grpc.StatusCode.UNAVAILABLE,
            "TRANSCRIPT_UNAVAILABLE",
        )
        proxy.unavailable.clear()
        retried = await stack.build("s1", run_id="run-7", trigger_point=api.TRIGGER_POINT_MID_LOOP)

        assert retried.compaction.trigger_mode == events_pb2.TRIGGER_MODE_MANUAL
        assert retried.compaction.outcome == events_pb2.COMPACTION_OUTCOME_COMPACTED


async def test_an_unexpected_failure_mid_compaction_is_recorded_and_the_request_still_answered(
    tmp_path: Path, database_url: str
) -> None:
    async with running_stack(tmp_path, database_url, ScriptedProvider(crash_calls={0})) as stack:
        ids = await _history(stack)

        response = await stack.build("s1")

        assert response.compaction.outcome == events_pb2.COMPACTION_OUTCOME_FAILED
        assert [m.message_id for m in response.messages] == ids
        (event,) = await _events(stack)
        assert (event.outcome, event.trigger_mode) == (
            events_pb2.COMPACTION_OUTCOME_FAILED,
            events_pb2.TRIGGER_MODE_REQUEST_START,
        )
        assert await stack.record_rows("s1") == []


async def test_automatic_mid_loop_compaction_records_its_trigger(stack: Stack) -> None:
    await _history(stack)
    rounds = await stack.append("s1", user("current"), assistant("a", "c1"), tool("c1", "ok"), assistant("b", "c2"))
    rounds += await stack.append("s1", tool("c2", "ok"))

    response = await stack.build("s1", trigger_point=api.TRIGGER_POINT_MID_LOOP)

    assert response.compaction.trigger_mode == events_pb2.TRIGGER_MODE_MID_LOOP
    assert response.boundary_message_id == rounds[2]
    (event,) = await _events(stack)
    assert event.trigger_mode == events_pb2.TRIGGER_MODE_MID_LOOP
