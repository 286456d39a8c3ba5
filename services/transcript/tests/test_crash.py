"""kill -9 in the middle of appends: every batch is all or nothing, and every acknowledged batch
survives the restart."""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from pathlib import Path

import grpc
from transcript_testing import SERVICE_TOKEN, all_messages, serve_in_subprocess, user

from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum.transcript.v1 import transcript_service_pb2_grpc as api_grpc
from continuum_runtime.auth import call_metadata
from continuum_runtime.channels import open_channel

BATCH = 20


async def _writer(
    stub: api_grpc.TranscriptServiceStub, writer: int, acknowledged: list[str], enough: asyncio.Event
) -> None:
    metadata = call_metadata(SERVICE_TOKEN, "alice")
    for number in range(10_000):
        tag = f"w{writer}-b{number}"
        batch = [user(f"{tag} message {i} " + "x" * 2000) for i in range(BATCH)]
        for message in batch:
            message.metadata.update({"batch": tag})
        try:
            await stub.AppendMessages(api.AppendMessagesRequest(session_id="s", messages=batch), metadata=metadata)
        except grpc.aio.AioRpcError:
            return
        acknowledged.append(tag)
        if len(acknowledged) >= 20:
            enough.set()


async def test_kill_9_mid_append_loses_no_acknowledged_batch_and_splits_none(tmp_path: Path, database_url: str) -> None:
    process, port = await serve_in_subprocess(tmp_path, database_url)
    acknowledged: list[str] = []
    channel = open_channel(f"127.0.0.1:{port}")
    stub = api_grpc.TranscriptServiceStub(channel)
    try:
        await stub.CreateSession(
            api.CreateSessionRequest(session_id="s"), metadata=call_metadata(SERVICE_TOKEN, "alice")
        )
        enough = asyncio.Event()
        writers = [asyncio.create_task(_writer(stub, w, acknowledged, enough)) for w in range(4)]
        await asyncio.wait_for(enough.wait(), 60)
        process.send_signal(signal.SIGKILL)
        await process.wait()
        await asyncio.gather(*writers)
    finally:
        await channel.close()
        if process.returncode is None:
            process.kill()

    process, port = await serve_in_subprocess(tmp_path, database_url)
    channel = open_channel(f"127.0.0.1:{port}")
    stub = api_grpc.TranscriptServiceStub(channel)
    try:
        stored = await all_messages(stub, call_metadata(SERVICE_TOKEN, "alice"), "s")
        counts = Counter(m.metadata["batch"] for m in stored)
    finally:
        await channel.close()
        process.send_signal(signal.SIGTERM)
        await process.wait()
    assert set(acknowledged) <= set(counts), "an acknowledged batch was lost"
    assert all(count == BATCH for count in counts.values()), "a batch was split by the crash"
