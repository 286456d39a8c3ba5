"""Manual compaction (seed 004 §5.4, §7): idle runs under a compaction claim, running queues a signal
bound to the run, a stale signal never fires, disabled auto compaction does not disable manual."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest
from clock_testing import START_MS, ManualClock
from compaction_testing import (
    CRASH_TEXT,
    RecordingProxy,
    ScriptedProvider,
    Stack,
    compaction_settings,
    running_stack,
    runtime_events,
    status_code,
    summarized_ids,
)
from deadline_testing import eventually
from google.protobuf import duration_pb2, timestamp_pb2
from transcript_testing import Follower, assistant, refused, tool, user

from continuum.compaction.events.v1 import events_pb2
from continuum.compaction.v1 import compaction_service_pb2 as api
from continuum.compaction.v1 import compaction_service_pb2_grpc as api_grpc
from continuum.compaction.v1 import resources_pb2 as pb
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as tapi
from continuum_compaction.server import start
from continuum_runtime.channels import open_channel
from continuum_runtime.logs import JsonFormatter


async def _history(stack: Stack, turns: int = 3) -> list[int]:
    await stack.new_session("s1")
    ids: list[int] = []
    for index in range(turns):
        ids += await stack.append("s1", user(f"request {index}"), assistant(f"answer {index}"))
    return ids


def _claim(kind: tpb.ClaimKind.ValueType, holder: str, session_id: str = "s1") -> tapi.AcquireClaimsRequest:
    return tapi.AcquireClaimsRequest(
        session_ids=[session_id], kind=kind, holder=holder, ttl=duration_pb2.Duration(seconds=60)
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
    merge = await stack.transcript.stub.AcquireClaims(_claim(tpb.CLAIM_KIND_MERGE, "merge-1"), metadata=stack.user())

    details = await refused(_compact_now(stack), grpc.StatusCode.FAILED_PRECONDITION, "SESSION_BUSY")

    # Who holds the session, and until when unless renewed.
    assert details.metadata == {
        "session_id": "s1",
        "holder_kind": "CLAIM_KIND_MERGE",
        "holder": "merge-1",
        "expire_time": merge.claim.expire_time.ToJsonString(),
    }


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


async def test_a_provider_failure_mid_compaction_is_recorded_and_the_request_still_answered(
    tmp_path: Path, database_url: str
) -> None:
    async with running_stack(tmp_path, database_url, ScriptedProvider(fail_calls={0})) as stack:
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


async def test_transcript_failing_mid_compaction_is_recorded_and_the_request_still_answered(
    tmp_path: Path, database_url: str
) -> None:
    proxy = RecordingProxy()
    async with running_stack(tmp_path, database_url, proxy=proxy) as stack:
        ids = await _history(stack)
        # The summary is written; moving transcript's fence up to it fails.
        proxy.unavailable.add("SetCompactionFence")

        response = await stack.build("s1")

        assert response.compaction.outcome == events_pb2.COMPACTION_OUTCOME_FAILED
        assert [m.message_id for m in response.messages] == ids
        (event,) = await _events(stack)
        assert event.outcome == events_pb2.COMPACTION_OUTCOME_FAILED
        assert await stack.record_rows("s1") == []


async def test_a_bug_mid_compaction_is_internal_and_logged_with_its_frames(
    tmp_path: Path, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_stack(tmp_path, database_url, ScriptedProvider(crash_calls={0})) as stack:
        await _history(stack)

        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stack.build("s1")

        assert status_code(raised.value) == grpc.StatusCode.INTERNAL
        # Not recorded as an outcome of compaction: nothing it depends on failed.
        assert await _events(stack) == []
        assert await stack.record_rows("s1") == []
    (record,) = [r for r in caplog.records if r.name == "continuum.rpc" and r.getMessage() == "rpc failed"]
    line = JsonFormatter().format(record)
    assert CRASH_TEXT not in line
    entry = json.loads(line)
    assert entry["exception"] == "TypeError"
    assert entry["method"] == "/continuum.compaction.v1.CompactionService/BuildContext"
    functions = [(Path(frame["file"]).name, frame["function"]) for frame in entry["frames"]]
    # From the handler down to the line that raised, in the provider the service was given.
    assert functions[-1] == ("compaction_testing.py", "ScriptedProvider.complete")
    assert ("compactor.py", "Compactor.compact") in functions
    assert all(isinstance(frame["line"], int) for frame in entry["frames"])


async def test_automatic_mid_loop_compaction_records_its_trigger(stack: Stack) -> None:
    await _history(stack)
    rounds = await stack.append("s1", user("current"), assistant("a", "c1"), tool("c1", "ok"), assistant("b", "c2"))
    rounds += await stack.append("s1", tool("c2", "ok"))

    response = await stack.build("s1", trigger_point=api.TRIGGER_POINT_MID_LOOP)

    assert response.compaction.trigger_mode == events_pb2.TRIGGER_MODE_MID_LOOP
    assert response.boundary_message_id == rounds[2]
    (event,) = await _events(stack)
    assert event.trigger_mode == events_pb2.TRIGGER_MODE_MID_LOOP


async def _run_refusal(stack: Stack, session_id: str = "s1") -> dict[str, str]:
    """The metadata of transcript's refusal of a new turn: who holds the session, until when."""
    details = await refused(
        stack.transcript.stub.AcquireClaims(_claim(tpb.CLAIM_KIND_RUN, "run-9", session_id), metadata=stack.user()),
        grpc.StatusCode.FAILED_PRECONDITION,
        "SESSION_ALREADY_RUNNING",
    )
    return details.metadata


def _rfc3339(epoch_ms: int) -> str:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromMilliseconds(epoch_ms)
    return stamp.ToJsonString()


async def test_a_slow_idle_compaction_keeps_its_short_lease_by_heartbeat(tmp_path: Path, database_url: str) -> None:
    clock = ManualClock()
    gate = asyncio.Event()
    async with running_stack(
        tmp_path,
        database_url,
        ScriptedProvider(gate=gate),
        clock=clock,
        auto_compaction=False,
        consume_session_events=False,
    ) as stack:
        await _history(stack)
        compacting = asyncio.create_task(_compact_now(stack))
        # The model works; the heartbeat waits for its next beat.
        await eventually(lambda: stack.provider.waiting == 1 and clock.sleepers == 1)
        holder = await _run_refusal(stack)
        assert holder["holder_kind"] == "CLAIM_KIND_COMPACTION"
        assert holder["holder"].startswith("compaction:")
        assert holder["expire_time"] == _rfc3339(START_MS + 15_000)

        # 20 s pass, more than the 15 s lease: every 5 s beat moves the lease's end on.
        for beat in range(1, 5):
            clock.advance(5)
            renewed_until = _rfc3339(START_MS + beat * 5_000 + 15_000)

            async def renewed(until: str = renewed_until) -> bool:
                return (await _run_refusal(stack))["expire_time"] == until and clock.sleepers == 1

            await eventually(renewed)
        gate.set()
        response = await compacting

        assert response.report.outcome == events_pb2.COMPACTION_OUTCOME_COMPACTED
        claim = await stack.transcript.stub.AcquireClaims(_claim(tpb.CLAIM_KIND_RUN, "run-9"), metadata=stack.user())
        assert claim.claim.claim_id


async def test_a_restarted_replica_releases_what_its_previous_start_held_and_nothing_else(
    tmp_path: Path, database_url: str
) -> None:
    async with running_stack(tmp_path, database_url, auto_compaction=False) as stack:
        await _history(stack)
        await stack.new_session("s2")
        # What replica-a held when it was killed, and what replica-b (alive) holds right now.
        for session_id, holder in [("s1", "compaction:replica-a"), ("s2", "compaction:replica-b")]:
            await stack.transcript.stub.AcquireClaims(
                _claim(tpb.CLAIM_KIND_COMPACTION, holder, session_id), metadata=stack.user()
            )
        assert (await _compact_now(stack)).state == api.COMPACT_NOW_STATE_IN_PROGRESS

        settings = compaction_settings(
            tmp_path / "replica-a", database_url, stack.transcript.service.port, instance_id="replica-a"
        )
        restarted = await start(settings, ScriptedProvider())
        channel = open_channel(f"127.0.0.1:{restarted.port}")
        try:
            # Its first compaction waits for the release, then takes the session under its own name.
            response = await api_grpc.CompactionServiceStub(channel).CompactNow(
                api.CompactNowRequest(session_id="s1"), metadata=stack.user()
            )
        finally:
            await channel.close()
            await restarted.stop(grace=0)

        assert response.state == api.COMPACT_NOW_STATE_COMPLETED
        assert (await _run_refusal(stack, "s2"))["holder"] == "compaction:replica-b"
