"""The session events outbox (list, watch, resume, ordering) and attachment bytes."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import stat
from pathlib import Path

import grpc
import pytest
from transcript_testing import TranscriptClient, append, create_session, refused, running_transcript, user

from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum_runtime.server import write_port_file


async def _create(client: TranscriptClient, session_id: str, owner: str = "alice") -> None:
    await client.stub.CreateSession(api.CreateSessionRequest(session_id=session_id), metadata=client.as_user(owner))


async def _delete(client: TranscriptClient, session_id: str, owner: str = "alice") -> int:
    response = await client.stub.DeleteSession(
        api.DeleteSessionRequest(session_id=session_id), metadata=client.as_user(owner)
    )
    return int(response.event_id)


async def test_watch_streams_backlog_then_live_events_and_resumes(transcript: TranscriptClient) -> None:
    for name in ("one", "two", "three"):
        await _create(transcript, name)
    first = await _delete(transcript, "one")
    stream = transcript.stub.WatchSessionEvents(api.WatchSessionEventsRequest(), metadata=transcript.system)
    received = [(await stream.read()).event]
    assert received[0].event_id == first and list(received[0].deleted_session_ids) == ["one"]
    second = await _delete(transcript, "two")
    received.append((await asyncio.wait_for(stream.read(), 10)).event)
    assert received[1].event_id == second and received[1].type == pb.SESSION_EVENT_TYPE_DELETED
    stream.cancel()
    third = await _delete(transcript, "three")
    resumed = transcript.stub.WatchSessionEvents(
        api.WatchSessionEventsRequest(after_event_id=second), metadata=transcript.system
    )
    assert (await asyncio.wait_for(resumed.read(), 10)).event.event_id == third
    resumed.cancel()


async def test_events_are_filtered_for_an_acting_user(transcript: TranscriptClient) -> None:
    await _create(transcript, "a", "alice")
    await _create(transcript, "b", "bob")
    await _delete(transcript, "a", "alice")
    bobs = await _delete(transcript, "b", "bob")
    mine = await transcript.stub.ListSessionEvents(api.ListSessionEventsRequest(), metadata=transcript.as_user("bob"))
    assert [e.event_id for e in mine.events] == [bobs]
    everything = await transcript.stub.ListSessionEvents(
        api.ListSessionEventsRequest(page_size=1), metadata=transcript.system
    )
    assert len(everything.events) == 1 and everything.next_page_token
    rest = await transcript.stub.ListSessionEvents(
        api.ListSessionEventsRequest(page_size=1, page_token=everything.next_page_token), metadata=transcript.system
    )
    assert [e.event_id for e in rest.events] == [bobs]


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
async def test_concurrent_writers_commit_events_in_id_order(transcript: TranscriptClient) -> None:
    names = [f"s{i}" for i in range(30)]
    for name in names:
        await _create(transcript, name)
    stream = transcript.stub.WatchSessionEvents(api.WatchSessionEventsRequest(), metadata=transcript.system)
    ids = await asyncio.gather(*[_delete(transcript, name) for name in names])
    seen = [(await asyncio.wait_for(stream.read(), 10)).event.event_id for _ in names]
    stream.cancel()
    # A watcher never skips an event: it sees every id exactly once, in increasing order.
    assert seen == sorted(ids)


async def _upload(
    client: TranscriptClient, session_id: str, data: bytes, **header: object
) -> api.UploadAttachmentResponse:
    """Stream an upload the way a careful client does: stop writing once the server has answered."""
    call = client.stub.UploadAttachment(metadata=client.as_user("alice"))
    fields: dict[str, object] = {"session_id": session_id, "media_type": "image/png", "file_name": "a.png", **header}
    frames = [api.UploadAttachmentRequest(header=api.UploadAttachmentHeader(**fields))]  # type: ignore[arg-type]
    frames += [api.UploadAttachmentRequest(chunk=data[i : i + 64 * 1024]) for i in range(0, len(data), 64 * 1024)]
    try:
        for frame in frames:
            await call.write(frame)
        await call.done_writing()
    except asyncio.InvalidStateError:
        pass  # the server already ended the call; its status follows
    return await call  # type: ignore[no-any-return]


async def test_attachment_round_trip_and_reference(transcript: TranscriptClient) -> None:
    await _create(transcript, "s")
    data = bytes(range(256)) * 4096
    attachment = (await _upload(transcript, "s", data, size_bytes=len(data))).attachment
    assert attachment.size_bytes == len(data) and attachment.sha256 == hashlib.sha256(data).hexdigest()
    downloaded = b""
    async for frame in transcript.stub.DownloadAttachment(
        api.DownloadAttachmentRequest(attachment_id=attachment.attachment_id), metadata=transcript.as_user("alice")
    ):
        downloaded += frame.chunk
    assert downloaded == data
    reference = pb.ContentPart(attachment=pb.AttachmentReference(attachment_id=attachment.attachment_id))
    message = pb.NewMessage(role=pb.MESSAGE_ROLE_USER, content=[pb.ContentPart(text="look"), reference])
    stored = await transcript.stub.AppendMessages(
        api.AppendMessagesRequest(session_id="s", messages=[message]), metadata=transcript.as_user("alice")
    )
    read = await transcript.stub.GetMessage(
        api.GetMessageRequest(session_id="s", message_id=stored.message_ids[0]), metadata=transcript.as_user("alice")
    )
    assert read.message.content[1].attachment.media_type == "image/png"
    edited = await transcript.stub.EditUserMessage(
        api.EditUserMessageRequest(
            session_id="s", message_id=stored.message_ids[0], content=[pb.ContentPart(text="again"), reference]
        ),
        metadata=transcript.as_user("alice"),
    )
    assert edited.message.content[1].attachment.media_type == "image/png"
    await refused(
        transcript.stub.GetAttachment(
            api.GetAttachmentRequest(attachment_id=attachment.attachment_id), metadata=transcript.as_user("bob")
        ),
        grpc.StatusCode.PERMISSION_DENIED,
        "SESSION_PERMISSION_DENIED",
    )


async def test_oversize_or_malformed_uploads_leave_nothing(transcript: TranscriptClient) -> None:
    await _create(transcript, "s")
    limit = transcript.settings.max_attachment_bytes
    await refused(
        _upload(transcript, "s", b"x" * (limit + 1)), grpc.StatusCode.INVALID_ARGUMENT, "ATTACHMENT_TOO_LARGE"
    )
    await refused(
        _upload(transcript, "s", b"x", size_bytes=limit + 1), grpc.StatusCode.INVALID_ARGUMENT, "ATTACHMENT_TOO_LARGE"
    )
    await refused(_upload(transcript, "s", b"abc", size_bytes=4), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")
    await refused(
        _upload(transcript, "s", b"abc", media_type="not a type"), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"
    )
    store = transcript.settings.resolved_attachments_dir()
    leftovers = [p for p in store.rglob("*") if p.is_file()] if store.exists() else []
    assert leftovers == []


async def _refused_upload(transcript: TranscriptClient) -> grpc.aio.StreamUnaryCall:
    """An upload to a new session "s" whose header declares more than the limit (refused at once), the
    call left open."""
    await _create(transcript, "s")
    declared = transcript.settings.max_attachment_bytes + 1
    header = api.UploadAttachmentHeader(session_id="s", media_type="image/png", file_name="a.png", size_bytes=declared)
    call = transcript.stub.UploadAttachment(metadata=transcript.as_user("alice"))
    await call.write(api.UploadAttachmentRequest(header=header))
    return call


async def test_a_refused_upload_is_answered_once_its_client_has_sent_everything(transcript: TranscriptClient) -> None:
    """Refused at its header, the upload still reads what follows: answering while the client still
    writes makes grpc's client report INTERNAL (a write crossing the answer) instead of the refusal."""
    call = await _refused_upload(transcript)
    # Before, the answer came within milliseconds of the header; now it waits for the rest.
    await asyncio.sleep(0.3)
    assert not call.done(), "answered while the client was still sending"
    await call.write(api.UploadAttachmentRequest(chunk=b"x" * 64 * 1024))
    await call.done_writing()
    await refused(call, grpc.StatusCode.INVALID_ARGUMENT, "ATTACHMENT_TOO_LARGE")


async def test_a_refused_upload_whose_client_stalls_is_answered_after_a_bounded_wait(
    transcript: TranscriptClient,
) -> None:
    call = await _refused_upload(transcript)
    # Neither more bytes nor a half-close: the answer comes after REFUSED_UPLOAD_DRAIN_SECONDS.
    await asyncio.wait_for(refused(call, grpc.StatusCode.INVALID_ARGUMENT, "ATTACHMENT_TOO_LARGE"), 20)


async def test_a_refused_upload_whose_client_writes_on_is_answered_after_a_bounded_read(
    transcript: TranscriptClient,
) -> None:
    call = await _refused_upload(transcript)
    written = 0

    async def write_forever() -> None:
        nonlocal written
        with contextlib.suppress(asyncio.InvalidStateError, grpc.aio.AioRpcError):
            while True:
                await call.write(api.UploadAttachmentRequest(chunk=b"x" * 64 * 1024))
                written += 64 * 1024

    writer = asyncio.create_task(write_forever())
    try:
        # A write crossing the answer may turn it into INTERNAL on this side: such a client gave up its
        # right to a clean answer by writing on.
        code = await asyncio.wait_for(call.code(), 20)
    finally:
        writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await writer
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL)
    # The server stopped reading after REFUSED_UPLOAD_DRAIN_BYTES; what was written beyond them sat in
    # the flow-control windows (a few MiB). Reading on for its whole time bound takes hundreds of MiB.
    assert written < 32 * 1024 * 1024, f"the server read {written} bytes of a refused upload"


async def test_upload_must_start_with_its_header(transcript: TranscriptClient) -> None:
    await _create(transcript, "s")
    call = transcript.stub.UploadAttachment(metadata=transcript.as_user("alice"))
    try:
        await call.write(api.UploadAttachmentRequest(chunk=b"bytes first"))
        await call.done_writing()
    except asyncio.InvalidStateError:
        pass
    await refused(call, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")
    store = transcript.settings.resolved_attachments_dir()
    assert not store.exists() or not [p for p in store.rglob("*") if p.is_file()]


async def test_a_service_started_on_its_own_keeps_its_files_private(tmp_path: Path) -> None:
    """Without `continuum up`'s umask (a service run by hand or in a container): the database, its
    WAL, attachments and run files are still readable by their owner only."""
    data_dir = tmp_path / "data"
    database_url = f"sqlite+aiosqlite:///{data_dir / 'transcript.db'}"
    umask = os.umask(0o022)  # a common default; `continuum up` would have set 077
    try:
        async with running_transcript(tmp_path, database_url) as client:
            session_id = await create_session(client)
            await append(client, session_id, user("hello"))
            await _upload(client, session_id, b"\x89PNG" + b"\0" * 1000)
            write_port_file(data_dir, "transcript", client.service.port)
    finally:
        os.umask(umask)
    modes = {
        str(path.relative_to(data_dir)): stat.S_IMODE(path.stat().st_mode) for path in [data_dir, *data_dir.rglob("*")]
    }
    assert {"transcript.db", "run/transcript.port"} <= set(modes)
    assert any(name.startswith("attachments/") and not name.endswith("incoming") for name in modes), modes
    loose = {name: oct(mode) for name, mode in modes.items() if mode & 0o077}
    assert loose == {}, loose
