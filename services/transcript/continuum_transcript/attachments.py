"""Attachment bytes: streamed to a temporary file, hashed, renamed into a content-addressed
store, then recorded. A crash leaves at most an unreferenced file, never a row without bytes."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from sqlalchemy import RowMapping, insert, select
from sqlalchemy.ext.asyncio import AsyncConnection

from continuum_transcript import sessions
from continuum_transcript.errors import AttachmentNotFound, AttachmentTooLarge, BadRequest
from continuum_transcript.tables import attachments

MEDIA_TYPE = re.compile(r"^[A-Za-z0-9!#$&^_.+-]{1,127}/[A-Za-z0-9!#$&^_.+-]{1,127}$")
MAX_FILE_NAME_CHARS = 255
DOWNLOAD_CHUNK_BYTES = 1024 * 1024


@dataclass(frozen=True)
class StoredBytes:
    """Bytes that reached the store."""

    sha256: str
    size_bytes: int


class AttachmentStore:
    """Content-addressed files under one directory (a volume in production)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path_of(self, sha256: str) -> Path:
        """Where bytes with this digest live."""
        return self.root / sha256[:2] / sha256

    async def receive(
        self, chunks: AsyncIterator[bytes], max_bytes: int, *, expected_size: int | None = None
    ) -> StoredBytes:
        """Write `chunks` durably; refuse (and discard) anything over `max_bytes` or of another
        size than the caller declared."""
        scratch_dir = self.root / "incoming"
        await asyncio.to_thread(_private_dir, scratch_dir)
        scratch = scratch_dir / uuid.uuid4().hex
        digest = hashlib.sha256()
        size = 0
        handle = await asyncio.to_thread(_private_file, scratch)
        try:
            async for chunk in chunks:
                size += len(chunk)
                if size > max_bytes:
                    raise AttachmentTooLarge(
                        f"attachments are limited to {max_bytes} bytes", metadata={"max_bytes": max_bytes}
                    )
                digest.update(chunk)
                await asyncio.to_thread(handle.write, chunk)
            if expected_size is not None and size != expected_size:
                raise BadRequest("header.size_bytes", f"declared {expected_size} bytes but {size} arrived")
            await asyncio.to_thread(_flush, handle)
        except BaseException:
            handle.close()
            scratch.unlink(missing_ok=True)
            raise
        handle.close()
        sha = digest.hexdigest()
        final = self.path_of(sha)
        await asyncio.to_thread(_private_dir, final.parent)
        await asyncio.to_thread(os.replace, scratch, final)
        return StoredBytes(sha, size)

    async def read(self, sha256: str) -> AsyncIterator[bytes]:
        """The stored bytes in chunks, read off the event loop."""
        handle = await asyncio.to_thread(self.path_of(sha256).open, "rb")
        try:
            while chunk := await asyncio.to_thread(handle.read, DOWNLOAD_CHUNK_BYTES):
                yield chunk
        finally:
            handle.close()


def _private_dir(path: Path) -> None:
    """Create `path` and any missing parent readable by this user only: attachments are users' data."""
    for directory in [*reversed(path.parents), path]:
        if not directory.exists():
            directory.mkdir(mode=0o700, exist_ok=True)


def _private_file(path: Path) -> BinaryIO:
    """A new file open for writing, readable by this user only from its first byte."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb")


def _flush(handle: object) -> None:
    handle.flush()  # type: ignore[attr-defined]
    os.fsync(handle.fileno())  # type: ignore[attr-defined]


def check_header(media_type: str, file_name: str) -> None:
    """Media type `type/subtype`; a file name without path separators or NUL."""
    if not MEDIA_TYPE.match(media_type):
        raise BadRequest("header.media_type", "must be a media type such as image/png")
    if len(file_name) > MAX_FILE_NAME_CHARS or any(c in file_name for c in "/\\\x00"):
        raise BadRequest("header.file_name", f"must be at most {MAX_FILE_NAME_CHARS} characters, no path")


async def record(
    connection: AsyncConnection,
    owner: str,
    session_id: str,
    media_type: str,
    file_name: str,
    stored: StoredBytes,
    now_ms: int,
) -> RowMapping:
    """Insert the attachment row for bytes already in the store."""
    await sessions.load(connection, owner, session_id)
    attachment_id = uuid.uuid4().hex
    await connection.execute(
        insert(attachments).values(
            attachment_id=attachment_id,
            session_id=session_id,
            owner=owner,
            media_type=media_type,
            file_name=file_name,
            size_bytes=stored.size_bytes,
            sha256=stored.sha256,
            create_ms=now_ms,
        )
    )
    return await load(connection, owner, attachment_id)


async def load(connection: AsyncConnection, owner: str, attachment_id: str) -> RowMapping:
    """An attachment of one of `owner`'s live sessions."""
    row = (
        (await connection.execute(select(attachments).where(attachments.c.attachment_id == attachment_id)))
        .mappings()
        .first()
    )
    if row is None:
        raise AttachmentNotFound("no such attachment", metadata={"attachment_id": attachment_id})
    await sessions.load(connection, owner, row["session_id"])
    return row
