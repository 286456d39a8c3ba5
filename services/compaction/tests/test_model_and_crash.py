"""Compaction through the real HTTP model client against a scripted server on loopback, and a kill -9
of the compaction process while the model is working: nothing half-written, nothing lost, and a session
it was compacting on its own is free again soon (sooner still when the process restarts)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import grpc
from compaction_testing import Stack, compaction_database_url, running_stack
from deadline_testing import eventually
from google.protobuf import duration_pb2
from model_server_testing import FakeModelServer, Reply, completion
from process_testing import serve_module
from pydantic import SecretStr
from sqlalchemy import text
from transcript_testing import SERVICE_TOKEN, TranscriptClient, assistant, running_transcript, user

from continuum.compaction.events.v1 import events_pb2
from continuum.compaction.v1 import compaction_service_pb2 as api
from continuum.compaction.v1 import compaction_service_pb2_grpc as api_grpc
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as tapi
from continuum_runtime.auth import call_metadata
from continuum_runtime.channels import open_channel
from continuum_runtime.database import Database
from continuum_runtime.errors import error_details
from continuum_runtime.provider import ProviderSettings


async def _three_turns(stack: Stack) -> None:
    await stack.new_session("s1")
    for n in range(3):
        await stack.append("s1", user(f"request {n}"), assistant(f"answer {n}"))


async def test_compaction_through_the_http_client(tmp_path: Path, database_url: str) -> None:
    server = FakeModelServer()
    await server.start()
    server.script(completion("Summary: requests 0-2 answered.", usage={"prompt_tokens": 321, "completion_tokens": 12}))
    provider = ProviderSettings(kind="openai", base_url=server.url, model="remote-model", api_key=SecretStr("k"))
    try:
        async with running_stack(tmp_path, database_url, configured_provider=True, provider=provider) as stack:
            await _three_turns(stack)

            response = await stack.build("s1")

            assert response.compaction.outcome == events_pb2.COMPACTION_OUTCOME_COMPACTED
            (request,) = server.requests
            body = request.json()
            assert body["model"] == "remote-model"
            assert body["messages"][0]["role"] == "system"
            assert any("request 1" in m["content"] for m in body["messages"])
            assert request.headers["authorization"] == "Bearer k"
            summary = (await stack.summary("s1")).summary
            assert summary.input_tokens == 321 and summary.output_tokens == 12
            assert summary.summary_text.startswith("Summary: requests 0-2 answered.")
    finally:
        await server.stop()


async def test_a_summary_cut_at_the_output_limit_is_never_accepted(tmp_path: Path, database_url: str) -> None:
    server = FakeModelServer()
    await server.start()
    server.script(completion("Summary: requests 0-", finish_reason="length"))
    provider = ProviderSettings(kind="openai", base_url=server.url, model="remote-model")
    try:
        async with running_stack(tmp_path, database_url, configured_provider=True, provider=provider) as stack:
            await _three_turns(stack)

            response = await stack.build("s1")

            assert response.compaction.outcome == events_pb2.COMPACTION_OUTCOME_FAILED
            assert await stack.record_rows("s1") == []
            # The request still gets its full context.
            assert len(response.messages) == 6
    finally:
        await server.stop()


async def _serve_compaction(
    tmp_path: Path, database_url: str, transcript_port: int, model_url: str, **settings: str
) -> tuple[asyncio.subprocess.Process, int]:
    """The compaction service as its own process; `settings` adds COMPACTION_<NAME> variables."""
    data_dir = tmp_path / "compaction-process"
    env = {
        "COMPACTION_DATA_DIR": str(data_dir),
        "COMPACTION_DATABASE_URL": compaction_database_url(database_url),
        "COMPACTION_PORT": "0",
        "COMPACTION_SERVICE_TOKEN": SERVICE_TOKEN,
        "COMPACTION_TRANSCRIPT_ADDRESS": f"127.0.0.1:{transcript_port}",
        "COMPACTION_CONTEXT_WINDOW_TOKENS": "1024",
        "COMPACTION_TRIGGER_RATIO": "0.01",
        "COMPACTION_RECENT_TURNS": "0",
        "COMPACTION_MIN_COMPACT_MESSAGE_COUNT": "1",
        "COMPACTION_MIN_NEW_MESSAGE_COUNT": "1",
        "COMPACTION_PROVIDER__KIND": "openai",
        "COMPACTION_PROVIDER__BASE_URL": model_url,
        "COMPACTION_PROVIDER__MODEL": "remote-model",
        **{f"COMPACTION_{name.upper()}": value for name, value in settings.items()},
    }
    return await serve_module("continuum_compaction", "compaction", data_dir, env)


async def test_kill_9_while_the_model_works_leaves_nothing_half_written(tmp_path: Path, database_url: str) -> None:
    server = FakeModelServer()
    await server.start()
    # The first summary never arrives before the kill; the second one does.
    server.script(Reply(delay_seconds=60), completion("Summary after restart."))
    metadata = call_metadata(SERVICE_TOKEN, "alice")
    try:
        async with running_transcript(tmp_path, database_url) as transcript:
            await transcript.stub.CreateSession(
                tapi.CreateSessionRequest(session_id="s1", kind=tpb.SESSION_KIND_CHAT), metadata=metadata
            )
            messages = [user("one"), assistant("1"), user("two"), assistant("2"), user("three")]
            await transcript.stub.AppendMessages(
                tapi.AppendMessagesRequest(session_id="s1", messages=messages), metadata=metadata
            )
            request = api.BuildContextRequest(
                session_id="s1", run_id="run-1", trigger_point=api.TRIGGER_POINT_REQUEST_START
            )
            process, port = await _serve_compaction(tmp_path, database_url, transcript.service.port, server.url)
            channel = open_channel(f"127.0.0.1:{port}")
            stub = api_grpc.CompactionServiceStub(channel)

            async def build() -> api.BuildContextResponse:
                response: api.BuildContextResponse = await stub.BuildContext(request, metadata=metadata)
                return response

            pending = asyncio.create_task(build())
            try:
                await eventually(lambda: len(server.requests) == 1)
            finally:
                # Killed in every case, so a failed wait leaves no server behind.
                process.send_signal(signal.SIGKILL)
                await process.wait()
            await asyncio.gather(pending, return_exceptions=True)
            await channel.close()

            database = Database(compaction_database_url(database_url), schema="compaction")
            try:
                async with database.connection() as connection:
                    records = (await connection.execute(text("SELECT count(*) FROM session_compactions"))).scalar()
                    events = (await connection.execute(text("SELECT count(*) FROM compaction_events"))).scalar()
            finally:
                await database.dispose()
            assert (records, events) == (0, 0)
            session = await transcript.stub.GetSession(tapi.GetSessionRequest(session_id="s1"), metadata=metadata)
            assert session.session.compaction_fence_message_id == 0

            process, port = await _serve_compaction(tmp_path, database_url, transcript.service.port, server.url)
            channel = open_channel(f"127.0.0.1:{port}")
            try:
                response = await api_grpc.CompactionServiceStub(channel).BuildContext(request, metadata=metadata)
            finally:
                await channel.close()
                process.send_signal(signal.SIGTERM)
                await process.wait()

            assert response.compaction.outcome == events_pb2.COMPACTION_OUTCOME_COMPACTED
            assert "Summary after restart." in response.messages[0].content[0].text
            assert len(server.requests) == 2
    finally:
        await server.stop()


async def _run_may_start(transcript: TranscriptClient) -> bool:
    """Whether a turn can take the session now (its claim is released again at once)."""
    metadata = call_metadata(SERVICE_TOKEN, "alice")
    request = tapi.AcquireClaimsRequest(
        session_ids=["s1"], kind=tpb.CLAIM_KIND_RUN, holder="run-2", ttl=duration_pb2.Duration(seconds=30)
    )
    try:
        response = await transcript.stub.AcquireClaims(request, metadata=metadata)
    except grpc.aio.AioRpcError as error:
        if error_details(error).reason == "SESSION_ALREADY_RUNNING":
            return False
        raise
    await transcript.stub.ReleaseClaims(tapi.ReleaseClaimsRequest(claim_id=response.claim.claim_id), metadata=metadata)
    return True


async def _kill_during_compact_now(
    tmp_path: Path, database_url: str, transcript: TranscriptClient, model: FakeModelServer, **settings: str
) -> None:
    """Start compaction, ask it to compact the idle session s1, kill -9 it while the model works."""
    metadata = call_metadata(SERVICE_TOKEN, "alice")
    await transcript.stub.CreateSession(
        tapi.CreateSessionRequest(session_id="s1", kind=tpb.SESSION_KIND_CHAT), metadata=metadata
    )
    messages = [user("one"), assistant("1"), user("two"), assistant("2"), user("three")]
    await transcript.stub.AppendMessages(
        tapi.AppendMessagesRequest(session_id="s1", messages=messages), metadata=metadata
    )
    process, port = await _serve_compaction(tmp_path, database_url, transcript.service.port, model.url, **settings)
    channel = open_channel(f"127.0.0.1:{port}")
    pending = asyncio.ensure_future(
        api_grpc.CompactionServiceStub(channel).CompactNow(api.CompactNowRequest(session_id="s1"), metadata=metadata)
    )
    try:
        await eventually(lambda: len(model.requests) == 1)
    finally:
        process.send_signal(signal.SIGKILL)
        await process.wait()
    await asyncio.gather(pending, return_exceptions=True)
    await channel.close()
    # The claim outlived the process.
    assert not await _run_may_start(transcript)


async def test_kill_9_during_compact_now_frees_the_session_when_the_short_lease_ends(
    tmp_path: Path, database_url: str
) -> None:
    model = FakeModelServer()
    await model.start()
    model.script(Reply(delay_seconds=60))
    try:
        async with running_transcript(tmp_path, database_url) as transcript:
            await _kill_during_compact_now(tmp_path, database_url, transcript, model)

            # Nobody renews the claim: its lease (15 s by default) ends and a turn can start.
            await eventually(lambda: _run_may_start(transcript), seconds=45)
    finally:
        await model.stop()


async def test_kill_9_during_compact_now_then_a_restart_frees_the_session_at_once(
    tmp_path: Path, database_url: str
) -> None:
    model = FakeModelServer()
    await model.start()
    model.script(Reply(delay_seconds=60))
    # A lease far longer than the wait below: only the restarted replica's release can free the session.
    replica = {"instance_id": "replica-a", "claim_ttl_seconds": "3600"}
    try:
        async with running_transcript(tmp_path, database_url) as transcript:
            await _kill_during_compact_now(tmp_path, database_url, transcript, model, **replica)

            process, _ = await _serve_compaction(tmp_path, database_url, transcript.service.port, model.url, **replica)
            try:
                await eventually(lambda: _run_may_start(transcript), seconds=30)
            finally:
                process.send_signal(signal.SIGTERM)
                await process.wait()
    finally:
        await model.stop()
