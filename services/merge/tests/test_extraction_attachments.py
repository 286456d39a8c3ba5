"""Fault row "unsupported critical attachment" of seed 000 §6.3, end to end on each backend: a user message
that is nothing but an attachment nothing can read pauses the merge (RECORD_REQUIRES_HANDLING) before its
unit asks a model; the originals and the units completed before it stay, and resuming does not edit the
sealed package. An unreadable attachment beside the user's own words, or a readable one alone, does not
pause."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

from deadline_testing import eventually
from merge_testing import MergeStack, running_merge
from sqlalchemy import select
from stages_testing import FAST, attempts, merged_sessions, new_session, tool_rounds
from transcript_testing import TranscriptClient, append, user

from continuum.merge.v1 import error_code_pb2
from continuum.merge.v1 import merge_service_pb2 as api
from continuum.merge.v1 import resources_pb2 as pb
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as tapi
from continuum_merge.snapshot import verify_snapshot
from continuum_merge.tables import session_merge_units

ZIP_BYTES = b"PK\x03\x04" + b"requirements only in here" * 40


async def upload(transcript: TranscriptClient, session_id: str, data: bytes, media_type: str) -> str:
    """Upload attachment bytes to `session_id` as the owner; the attachment id."""

    async def frames() -> AsyncIterator[tapi.UploadAttachmentRequest]:
        header = tapi.UploadAttachmentHeader(session_id=session_id, media_type=media_type, file_name="spec")
        yield tapi.UploadAttachmentRequest(header=header)
        yield tapi.UploadAttachmentRequest(chunk=data)

    response = await transcript.stub.UploadAttachment(frames(), metadata=transcript.as_user("alice"))
    return str(response.attachment.attachment_id)


def with_attachment(attachment_id: str, text: str = "") -> tpb.NewMessage:
    """A USER message of the attachment, after `text` when given."""
    content = [tpb.ContentPart(text=text)] if text else []
    content.append(tpb.ContentPart(attachment=tpb.AttachmentReference(attachment_id=attachment_id)))
    return tpb.NewMessage(role=tpb.MESSAGE_ROLE_USER, content=content)


async def settled(stack: MergeStack, operation_id: str) -> pb.MergeOperation:
    """The operation once completed or paused."""

    async def done() -> bool:
        status = (await stack.get(operation_id)).progress.status
        return status in (pb.MERGE_STATUS_COMPLETED, pb.MERGE_STATUS_PAUSED)

    await eventually(done, what="the merge to complete or pause", seconds=90)
    return await stack.get(operation_id)


async def unit_states(stack: MergeStack, operation_id: str) -> list[tuple[str, str, int]]:
    """(unit id, state, attempts) in plan order."""
    table = session_merge_units
    async with stack.database.connection() as connection:
        rows = await connection.execute(
            select(table.c.unit_id, table.c.state, table.c.attempt_count)
            .where(table.c.operation_id == operation_id)
            .order_by(table.c.ordinal, table.c.unit_id)
        )
        return [(row.unit_id, row.state, row.attempt_count) for row in rows]


async def test_a_user_message_of_only_an_unreadable_attachment_pauses_keeping_originals_and_units(
    tmp_path: Path, database_url: str
) -> None:
    async with running_merge(tmp_path, database_url, overrides=FAST) as stack:
        # Long tool rounds first, so several units complete before the attachment's unit.
        await new_session(stack.transcript, "a")
        await tool_rounds(stack.transcript, "a")
        attachment = await upload(stack.transcript, "a", ZIP_BYTES, "application/zip")
        await append(stack.transcript, "a", with_attachment(attachment))
        await new_session(stack.transcript, "b")
        operation_id = (await stack.start(["a", "b"])).operation.progress.operation_id

        operation = await settled(stack, operation_id)
        progress = operation.progress
        assert progress.status == pb.MERGE_STATUS_PAUSED and progress.can_resume
        assert progress.error_code == error_code_pb2.RECORD_REQUIRES_HANDLING
        assert "unsupported types (application/zip)" in progress.error
        assert progress.snapshot_sealed and not progress.locked_source_session_ids
        states = await unit_states(stack, operation_id)
        done = [unit for unit in states if unit[1] == "completed"]
        assert done and len(done) < len(states), states
        package = stack.settings.resolved_package_root() / operation_id
        sealed = verify_snapshot(package)
        assets = list((package / "snapshot" / "assets").iterdir())
        assert [path.read_bytes() for path in assets] == [ZIP_BYTES]
        assert all((package / "work" / f"{unit_id}.json").exists() for unit_id, _, _ in done)

        await stack.stub.ResumeMerge(
            api.ResumeMergeRequest(operation_id=operation_id, expected_epoch=progress.run_epoch),
            metadata=stack.user(),
        )

        async def paused_again() -> bool:
            again = (await stack.get(operation_id)).progress
            return again.status == pb.MERGE_STATUS_PAUSED and again.run_epoch > progress.run_epoch

        await eventually(paused_again, what="the resumed merge to pause again", seconds=90)
        again = (await stack.get(operation_id)).progress
        assert again.error_code == error_code_pb2.RECORD_REQUIRES_HANDLING
        # Completed units were reused, not asked again; the sealed package is the same one.
        assert [unit for unit in await unit_states(stack, operation_id) if unit[1] == "completed"] == done
        assert verify_snapshot(package).snapshot_hash == sealed.snapshot_hash
        assert not await merged_sessions(stack.transcript)


async def test_unreadable_attachments_beside_words_and_readable_ones_alone_do_not_pause(
    tmp_path: Path, database_url: str
) -> None:
    async with running_merge(tmp_path, database_url, overrides=FAST) as stack:
        await new_session(stack.transcript, "a")
        archive = await upload(stack.transcript, "a", ZIP_BYTES, "application/zip")
        image = await upload(stack.transcript, "a", b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, "image/png")
        notes = await upload(stack.transcript, "a", b"# notes\nkeep the name field", "text/markdown")
        await append(
            stack.transcript,
            "a",
            with_attachment(archive, "The archive holds old logs; the ask: rename name to displayName."),
            with_attachment(image),
            with_attachment(notes),
            user("thanks"),
        )
        await new_session(stack.transcript, "b")
        operation_id = (await stack.start(["a", "b"])).operation.progress.operation_id

        operation = await settled(stack, operation_id)
        assert operation.progress.status == pb.MERGE_STATUS_COMPLETED, operation.progress
        units, outcomes = await attempts(stack.database, operation_id)
        assert outcomes == {"completed": units}
