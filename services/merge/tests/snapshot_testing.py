"""A real transcript for snapshot tests, and builders of source histories (importable as
`snapshot_testing`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf import struct_pb2
from transcript_testing import TranscriptClient, running_transcript

from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum_merge.snapshot import SourceCut, TranscriptSourceReader, capture_cut
from continuum_merge.snapshot.verify import iter_jsonl

OWNER = "alice"


@dataclass
class Sources:
    """Transcript with helpers acting for `OWNER`, and a snapshot reader over it."""

    client: TranscriptClient
    reader: TranscriptSourceReader

    @property
    def user(self) -> tuple[tuple[str, str], ...]:
        """Call metadata of the owner."""
        return self.client.as_user(OWNER)

    async def session(
        self,
        session_id: str,
        *,
        parent: str = "",
        kind: tpb.SessionKind.ValueType = tpb.SESSION_KIND_CHAT,
        metadata: dict[str, Any] | None = None,
    ) -> str:
        """Create a session (a child when `parent` is given)."""
        struct = struct_pb2.Struct()
        struct.update(metadata or {})
        await self.client.stub.CreateSession(
            api.CreateSessionRequest(
                session_id=session_id, parent_session_id=parent, kind=kind, title=f"title of {session_id}",
                metadata=struct,
            ),
            metadata=self.user,
        )  # fmt: skip
        return session_id

    async def append(self, session_id: str, *messages: tpb.NewMessage) -> list[int]:
        """Append one batch; the new ids."""
        response = await self.client.stub.AppendMessages(
            api.AppendMessagesRequest(session_id=session_id, messages=list(messages)), metadata=self.user
        )
        return list(response.message_ids)

    async def upload(self, session_id: str, data: bytes, media_type: str = "image/png") -> str:
        """Upload attachment bytes in 64 KiB chunks; the attachment id."""

        async def frames() -> AsyncIterator[api.UploadAttachmentRequest]:
            header = api.UploadAttachmentHeader(
                session_id=session_id, media_type=media_type, file_name="screen shot.png"
            )
            yield api.UploadAttachmentRequest(header=header)
            for start in range(0, len(data), 65536):
                yield api.UploadAttachmentRequest(chunk=data[start : start + 65536])

        response = await self.client.stub.UploadAttachment(frames(), metadata=self.user)
        return str(response.attachment.attachment_id)

    async def delete(self, session_id: str) -> None:
        """Delete a session (and its subtree)."""
        await self.client.stub.DeleteSession(api.DeleteSessionRequest(session_id=session_id), metadata=self.user)

    async def cuts(self, *roots: str) -> list[SourceCut]:
        """Each root's cut, as admission records it."""
        return [await capture_cut(self.reader, root) for root in roots]


@asynccontextmanager
async def running_sources(tmp_path: Path, database_url: str) -> AsyncIterator[Sources]:
    """Transcript on `database_url` (port 0) and a reader acting for the owner."""
    async with running_transcript(tmp_path, database_url) as client:
        yield Sources(client, TranscriptSourceReader(client.stub, client.as_user(OWNER), 30.0))


def text_message(role: tpb.MessageRole.ValueType, text: str, **fields: Any) -> tpb.NewMessage:
    """A message with one text part."""
    return tpb.NewMessage(role=role, content=[tpb.ContentPart(text=text)], **fields)


def rows(package_dir: Path, name: str) -> list[dict[str, Any]]:
    """Every row of one of the sealed snapshot's JSONL streams."""
    return list(iter_jsonl(package_dir / "snapshot" / name))


def record_texts(package_dir: Path, record_ref: str) -> list[bytes]:
    """A record's text parts, in order."""
    parts = [
        row for row in rows(package_dir, "files.jsonl") if row["recordRef"] == record_ref and row["kind"] == "text"
    ]
    return [(package_dir / "snapshot" / row["path"]).read_bytes() for row in sorted(parts, key=lambda r: r["part"])]


def message_refs(package_dir: Path, session_id: str) -> dict[int, str]:
    """Message id → recordRef of the message records of one session."""
    return {
        int(row["origin"]["recordId"]): row["recordRef"]
        for row in rows(package_dir, "records.jsonl")
        if row["origin"]["kind"] == "message" and row["origin"]["sessionId"] == session_id
    }


def ids(values: Sequence[int]) -> list[int]:
    """A sorted copy (for comparing id lists)."""
    return sorted(values)
