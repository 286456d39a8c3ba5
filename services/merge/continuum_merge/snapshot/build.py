"""Building a snapshot: copy every source tree up to its cut into staging/, then seal.

The copy holds a bounded number of message pages in memory (a few read ahead, one being prepared, one
whose files the writer threads are creating) and one attachment chunk, never a session's history.
Records are deduplicated by identity and version against the raw files already written (the file system
is the set). A source that is
itself a completed merge target contributes its own package's originals first, keeping their identity
and version, then its messages. The seal is: every stream closed, manifest.json and seal.json written,
the whole staging tree made durable at once (`TreeSync`), staging/ renamed to snapshot/ and the
package directory synced.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from continuum.transcript.v1 import resources_pb2 as tpb
from continuum_merge.snapshot.errors import PackageDamaged, SourceChanged, SourceMissing
from continuum_merge.snapshot.layout import (
    AFTER_SEAL,
    BEFORE_SEAL,
    FILES,
    FORMAT,
    GAPS,
    MANIFEST,
    OCCURRENCES,
    OPERATION_ID,
    RECORDS,
    SEAL,
    SNAPSHOT,
    STAGING,
    SealedSnapshot,
    SourceCut,
    asset_path,
    raw_path,
)
from continuum_merge.snapshot.reader import AttachmentUnreadable, SourceReader
from continuum_merge.snapshot.records import (
    BLOCKED,
    PreparedRecord,
    canonical,
    prepare_message,
    prepare_session,
    sha256_hex,
)
from continuum_merge.snapshot.verify import iter_jsonl, verify_snapshot
from continuum_merge.snapshot.writer import (
    PackageWriter,
    TreeSync,
    disk_free,
    fresh_directory,
    pin_allocator_threshold,
    sync_directory,
)
from continuum_runtime.wire_names import MERGE_OPERATION_METADATA_KEY

# Pages of messages read ahead of the one being written.
PAGES_AHEAD = 3
# An attachment whose bytes differ from transcript's recorded digest is read once more, then refused.
ATTACHMENT_READS = 2


def _no_failpoint(_: str) -> None:
    return None


async def build_snapshot(
    reader: SourceReader,
    sources: Sequence[SourceCut],
    package_dir: Path,
    *,
    version: int,
    disk_reserve_bytes: int,
    failpoint: Callable[[str], None] = _no_failpoint,
    free_space: Callable[[Path], int] = disk_free,
) -> SealedSnapshot:
    """Copy `sources` up to their cuts into `<package_dir>/staging/` (anything an earlier attempt left
    there is discarded, never spliced) and seal it as `<package_dir>/snapshot/` with `version`.

    An unsealed `snapshot/` of an earlier attempt that was never recorded is replaced. Earlier merges'
    packages are looked up beside this one: `<package_dir>/../<operation id>/snapshot/`.
    Raises SourceMissing, SourceChanged, SourceUnavailable, DiskReserveShort or PackageDamaged (an
    earlier merge's package that a source depends on); staging is left behind for the next attempt
    to discard.
    """
    if version < 1:
        raise ValueError("version must be at least 1")
    if not sources:
        raise ValueError("a snapshot needs at least one source")
    pin_allocator_threshold()
    staging = package_dir / STAGING
    await asyncio.to_thread(fresh_directory, staging)
    # Watching for write-back errors from before the first file is written until the seal's sync.
    tree = await asyncio.to_thread(TreeSync, staging)
    try:
        return await _write_and_seal(
            reader, sources, package_dir, version, tree, failpoint, disk_reserve_bytes, free_space
        )
    finally:
        tree.close()


async def _write_and_seal(
    reader: SourceReader,
    sources: Sequence[SourceCut],
    package_dir: Path,
    version: int,
    tree: TreeSync,
    failpoint: Callable[[str], None],
    disk_reserve_bytes: int,
    free_space: Callable[[Path], int],
) -> SealedSnapshot:
    staging = package_dir / STAGING
    writer = await asyncio.to_thread(PackageWriter, staging, disk_reserve_bytes, free_space)
    try:
        for source in sources:
            await _copy_source(reader, source, writer, package_dir)
        await asyncio.to_thread(writer.flush)
    finally:
        await asyncio.to_thread(writer.close)
    manifest = {
        "format": FORMAT,
        "version": version,
        "operationId": package_dir.name,
        # Only the roots: each session's cut is in its session record.
        "sources": [
            {
                "rootSessionId": source.root_session_id,
                "sessionCount": len(source.session_ids),
                "lastMessageId": source.last_message_ids.get(source.root_session_id, 0),
            }
            for source in sources
        ],
        "priorOperationIds": writer.priors,
        "streams": {name: stream.describe() for name, stream in writer.streams.items()},
        "byteCount": writer.byte_count,
        "blockingRecordRefs": writer.blocking,
    }
    sealed = await asyncio.to_thread(_seal, package_dir, manifest, tree, failpoint)
    failpoint(AFTER_SEAL)
    return sealed


def _seal(
    package_dir: Path, manifest: dict[str, Any], tree: TreeSync, failpoint: Callable[[str], None]
) -> SealedSnapshot:
    staging = package_dir / STAGING
    manifest_bytes = json.dumps(manifest, sort_keys=True, ensure_ascii=False, indent=1).encode()
    snapshot_hash = sha256_hex(manifest_bytes)
    seal = {"format": FORMAT, "version": manifest["version"], "manifestHash": snapshot_hash}
    for name, data in ((MANIFEST, manifest_bytes), (SEAL, canonical(seal))):
        with (staging / name).open("xb") as handle:
            handle.write(data)
    # Every file and directory entry of staging/ on disk before the rename makes it the snapshot.
    tree.sync()
    failpoint(BEFORE_SEAL)
    snapshot = package_dir / SNAPSHOT
    if snapshot.exists():
        # A snapshot sealed by an attempt that was never recorded: this attempt replaces it.
        shutil.rmtree(snapshot)
    staging.rename(snapshot)
    sync_directory(package_dir)
    records = manifest["streams"][RECORDS]["count"]
    return SealedSnapshot(
        manifest["version"], snapshot_hash, records, manifest["byteCount"], tuple(manifest["blockingRecordRefs"])
    )


async def _copy_source(reader: SourceReader, source: SourceCut, writer: PackageWriter, package_dir: Path) -> None:
    root = await reader.session(source.root_session_id)
    if root is None:
        raise SourceMissing(source.root_session_id)
    prior = root.metadata.fields.get(MERGE_OPERATION_METADATA_KEY)
    if root.kind == tpb.SESSION_KIND_MERGED and prior is not None:
        await asyncio.to_thread(_import_prior, writer, package_dir, prior.string_value, source.root_session_id)
    for session_id in source.session_ids:
        session = root if session_id == root.session_id else await reader.session(session_id)
        if session is None:
            await asyncio.to_thread(
                writer.gap, {"kind": "session_missing", "sessionId": session_id, "rootSessionId": root.session_id}
            )
            continue
        generation = source.history_generations.get(session_id, session.history_generation)
        if session.history_generation != generation:
            raise SourceChanged(session_id, "its history was rewritten after the cut")
        cut = source.last_message_ids.get(session_id, 0)
        await asyncio.to_thread(_add_session, writer, session, cut)
        if cut > 0:
            await _copy_messages(reader, writer, session, cut)
            # Pages are separate reads: an edit between two of them would splice two histories.
            after = await reader.session(session_id)
            if after is None or after.history_generation != generation:
                raise SourceChanged(session_id, "its history was rewritten or deleted during the copy")


def _add_session(writer: PackageWriter, session: tpb.Session, cut: int) -> None:
    record = prepare_session(session, cut)
    if writer.has_record(record.record_ref):
        writer.occurrence(
            {"recordRef": record.record_ref, "sessionId": session.session_id, "recordId": session.session_id}
        )
    else:
        writer.add_records([(record, [])])


async def _pages_ahead(pages: AsyncIterator[list[tpb.Message]]) -> AsyncIterator[list[tpb.Message]]:
    """`pages`, read by a task that stays up to PAGES_AHEAD pages ahead of the caller, so transcript
    keeps working while the caller writes (memory: that many pages more)."""
    ready: asyncio.Queue[list[tpb.Message] | BaseException | None] = asyncio.Queue(maxsize=PAGES_AHEAD)

    async def fetch() -> None:
        try:
            async for page in pages:
                await ready.put(page)
        except Exception as error:
            await ready.put(error)
            return
        await ready.put(None)

    fetching = asyncio.create_task(fetch())
    try:
        while (page := await ready.get()) is not None:
            if isinstance(page, BaseException):
                raise page
            yield page
    finally:
        fetching.cancel()
        await asyncio.gather(fetching, return_exceptions=True)
        aclose = getattr(pages, "aclose", None)
        if aclose is not None:
            await aclose()


async def _copy_messages(reader: SourceReader, writer: PackageWriter, session: tpb.Session, cut: int) -> None:
    async for page in _pages_ahead(reader.message_pages(session.session_id, cut)):
        assets: dict[str, dict[str, Any] | None] = {}
        for message in page:
            for part in message.content:
                if part.WhichOneof("part") == "attachment" and part.attachment.attachment_id not in assets:
                    attachment_id = part.attachment.attachment_id
                    assets[attachment_id] = await _copy_asset(reader, writer, session.session_id, attachment_id)
        await asyncio.to_thread(_write_page, writer, page, session.root_session_id, assets)


async def _copy_asset(
    reader: SourceReader, writer: PackageWriter, session_id: str, attachment_id: str
) -> dict[str, Any] | None:
    """Copy one attachment's bytes into assets/ (once per digest); its files row without the record,
    or None when transcript has no readable bytes for it (a gap)."""
    attachment = await reader.attachment(attachment_id)
    if attachment is None:
        return None
    for _ in range(ATTACHMENT_READS):
        if await asyncio.to_thread(writer.has_asset, attachment.sha256):
            return _asset_row(attachment)
        copy = await asyncio.to_thread(writer.open_asset)
        try:
            async for chunk in reader.attachment_bytes(attachment_id):
                await asyncio.to_thread(copy.write, chunk)
        except AttachmentUnreadable:
            await asyncio.to_thread(copy.discard)
            return None
        except BaseException:
            await asyncio.to_thread(copy.discard)
            raise
        if copy.sha256 == attachment.sha256 and copy.size == attachment.size_bytes:
            await asyncio.to_thread(copy.keep)
            return _asset_row(attachment)
        await asyncio.to_thread(copy.discard)
    raise SourceChanged(session_id, f"attachment {attachment_id} bytes differ from their recorded sha256")


def _asset_row(attachment: tpb.Attachment) -> dict[str, Any]:
    return {
        "ref": f"a_{attachment.sha256}",
        "part": None,
        "path": asset_path(attachment.sha256),
        "bytes": attachment.size_bytes,
        "sha256": attachment.sha256,
        "kind": "asset",
        "attachmentId": attachment.attachment_id,
        "mediaType": attachment.media_type,
    }


def _write_page(
    writer: PackageWriter, page: list[tpb.Message], root_session_id: str, assets: dict[str, dict[str, Any] | None]
) -> None:
    batch: list[tuple[PreparedRecord, list[dict[str, Any]]]] = []
    for message in page:
        record = prepare_message(message, root_session_id)
        position = {"sessionId": message.session_id, "recordId": str(message.message_id)}
        if writer.has_record(record.record_ref):
            writer.occurrence({"recordRef": record.record_ref, **position})
            continue
        rows: list[dict[str, Any]] = []
        for index, part in enumerate(message.content):
            if part.WhichOneof("part") != "attachment":
                continue
            row = assets.get(part.attachment.attachment_id)
            if row is None:
                writer.gap(
                    {"kind": "attachment_missing", "recordRef": record.record_ref, "attachmentId":
                     part.attachment.attachment_id, **position}
                )  # fmt: skip
            else:
                rows.append({**row, "part": index})
        batch.append((record, rows))
        if record.processing_policy == BLOCKED:
            writer.blocking.append(record.record_ref)
    writer.add_records(batch)


def _import_prior(writer: PackageWriter, package_dir: Path, operation_id: str, session_id: str) -> None:
    """Copy an earlier merge's originals (records with their identity and version, their files, the
    occurrences and gaps it recorded) from its sealed package, verified first."""
    if not OPERATION_ID.match(operation_id) or operation_id == package_dir.name:
        writer.gap({"kind": "prior_package_invalid", "sessionId": session_id})
        return
    prior = package_dir.parent / operation_id / SNAPSHOT
    if not prior.is_dir():
        writer.gap({"kind": "prior_package_missing", "sessionId": session_id, "operationId": operation_id})
        return
    verify_snapshot(prior.parent)
    writer.flush()
    writer.priors.append(operation_id)
    files = itertools.groupby(iter_jsonl(prior / FILES), key=lambda row: row["recordRef"])
    for record in iter_jsonl(prior / RECORDS):
        ref = record["recordRef"]
        group = next(files, None)
        if group is None or group[0] != ref:
            raise PackageDamaged(str(prior.parent), "files.jsonl is not in records.jsonl order")
        rows = list(group[1])
        if writer.has_record(ref):
            writer.occurrence({"recordRef": ref, "sessionId": session_id, "viaOperationId": operation_id})
            continue
        _import_record(writer, prior, record, rows)
        if record["processingPolicy"] == BLOCKED:
            writer.blocking.append(ref)
    for name in (OCCURRENCES, GAPS):
        for row in iter_jsonl(prior / name):
            writer.streams[name].write({**row, "viaOperationId": operation_id})


def _import_record(writer: PackageWriter, prior: Path, record: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    ref = record["recordRef"]
    if not rows or rows[0]["path"] != raw_path(ref):
        raise PackageDamaged(str(prior.parent), "a record's files do not start with its raw file")
    for row in rows:
        copy = row["kind"] != "asset" or not writer.has_asset(row["sha256"])
        if copy and writer.copy_record_file(prior / row["path"], row["path"]) != row["sha256"]:
            raise PackageDamaged(str(prior.parent), f"{row['path']} changed while it was copied")
        writer.byte_count += int(row["bytes"])
        writer.streams[FILES].write(row)
    writer.streams[RECORDS].write(record)
