"""The seal as a commit point: a crash before it leaves only staging (redone with a new version, never
spliced), a crash after it leaves a snapshot that verifies, and a short disk stops the copy."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from snapshot_testing import rows, running_sources, text_message

from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum_merge.snapshot import (
    AFTER_SEAL,
    BEFORE_SEAL,
    DiskReserveShort,
    SourceChanged,
    build_snapshot,
    verify_snapshot,
    writer,
)
from continuum_merge.snapshot.records import prepare_message, utf8_parts

MIB = 1024 * 1024


class Crash(Exception):
    """Stands for the process dying at a failpoint."""


def crash_at(name: str) -> Callable[[str], None]:
    """A failpoint that raises at `name`."""

    def failpoint(reached: str) -> None:
        if reached == name:
            raise Crash(reached)

    return failpoint


async def test_crash_before_the_seal_is_redone_with_a_new_version(tmp_path: Path, database_url: str) -> None:
    async with running_sources(tmp_path, database_url) as sources:
        await sources.session("a")
        await sources.append("a", text_message(tpb.MESSAGE_ROLE_USER, "one"))
        cuts = await sources.cuts("a")
        package = tmp_path / "op"
        with pytest.raises(Crash):
            await build_snapshot(
                sources.reader, cuts, package, version=1, disk_reserve_bytes=0, failpoint=crash_at(BEFORE_SEAL)
            )
        assert (package / "staging" / "seal.json").exists()
        assert not (package / "snapshot").exists()

        sealed = await build_snapshot(sources.reader, cuts, package, version=2, disk_reserve_bytes=0)
    assert sealed == verify_snapshot(package)
    assert sealed.version == 2 and sealed.record_count == 2
    assert not (package / "staging").exists()


async def test_crash_after_the_seal_leaves_a_snapshot_that_verifies(tmp_path: Path, database_url: str) -> None:
    async with running_sources(tmp_path, database_url) as sources:
        await sources.session("a")
        await sources.append("a", text_message(tpb.MESSAGE_ROLE_USER, "one"))
        cuts = await sources.cuts("a")
        package = tmp_path / "op"
        with pytest.raises(Crash):
            await build_snapshot(
                sources.reader, cuts, package, version=1, disk_reserve_bytes=0, failpoint=crash_at(AFTER_SEAL)
            )
        recovered = verify_snapshot(package)  # seal written, not recorded: verify and record
        assert recovered.version == 1 and recovered.record_count == 2

        # A rebuild (e.g. the verification had failed) replaces the unrecorded snapshot whole.
        await sources.append("a", text_message(tpb.MESSAGE_ROLE_ASSISTANT, "two"))
        rebuilt = await build_snapshot(
            sources.reader, await sources.cuts("a"), package, version=2, disk_reserve_bytes=0
        )
    assert rebuilt == verify_snapshot(package)
    assert rebuilt.version == 2 and rebuilt.record_count == 3


async def test_short_disk_stops_the_copy_and_a_resume_starts_over(tmp_path: Path, database_url: str) -> None:
    async with running_sources(tmp_path, database_url) as sources:
        await sources.session("a")
        await sources.upload("a", b"x")  # the store exists before any bytes are counted
        big = "y" * (3 * MIB // 2)
        await sources.append("a", *(text_message(tpb.MESSAGE_ROLE_USER, big) for _ in range(4)))
        cuts = await sources.cuts("a")
        package = tmp_path / "op"
        disk = 100 * MIB

        def shrinking(staging: Path) -> int:
            """A disk of `disk` bytes that only this copy writes to."""
            return disk - sum(path.stat().st_size for path in staging.rglob("*") if path.is_file())

        with pytest.raises(DiskReserveShort) as short:
            await build_snapshot(
                sources.reader, cuts, package, version=1, disk_reserve_bytes=99 * MIB, free_space=shrinking
            )
        # Free space is read every few MiB: the copy stopped before writing what would cross the reserve.
        assert short.value.reserve_bytes == 99 * MIB
        assert not (package / "snapshot").exists()
        written = sum(path.stat().st_size for path in (package / "staging").rglob("*") if path.is_file())
        assert written < 8 * MIB

        disk = 10_000 * MIB
        sealed = await build_snapshot(
            sources.reader, cuts, package, version=2, disk_reserve_bytes=99 * MIB, free_space=shrinking
        )
    assert sealed == verify_snapshot(package)
    assert len(rows(package, "records.jsonl")) == 5


async def test_the_tree_is_on_disk_before_the_rename_and_a_failed_sync_refuses_the_seal(
    tmp_path: Path, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[tuple[int, bool]] = []

    def syncfs(descriptor: int) -> int:
        """Records which file system was synced and whether the snapshot existed yet; fails once."""
        synced.append((os.fstat(descriptor).st_dev, (package / "snapshot").exists()))
        if len(synced) == 1:
            ctypes.set_errno(errno.EIO)
            return -1
        return 0

    monkeypatch.setattr(writer, "_SYNCFS", syncfs)
    async with running_sources(tmp_path, database_url) as sources:
        await sources.session("a")
        await sources.append("a", text_message(tpb.MESSAGE_ROLE_USER, "one"))
        cuts = await sources.cuts("a")
        package = tmp_path / "op"
        # A write-back error (a file of the tree may not be on disk): no seal.
        with pytest.raises(OSError, match="Input/output error") as failed:
            await build_snapshot(sources.reader, cuts, package, version=1, disk_reserve_bytes=0)
        assert failed.value.errno == errno.EIO
        assert not (package / "snapshot").exists()

        sealed = await build_snapshot(sources.reader, cuts, package, version=2, disk_reserve_bytes=0)
    assert sealed == verify_snapshot(package)
    assert synced == [(package.stat().st_dev, False)] * 2


async def test_without_syncfs_every_file_and_directory_is_fsynced(
    tmp_path: Path, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fsynced: set[str] = set()
    fsync = os.fsync

    def recording(descriptor: int) -> None:
        fsynced.add(os.readlink(f"/proc/self/fd/{descriptor}"))
        fsync(descriptor)

    monkeypatch.setattr(writer, "_SYNCFS", None)
    monkeypatch.setattr(os, "fsync", recording)
    async with running_sources(tmp_path, database_url) as sources:
        await sources.session("a")
        await sources.append("a", text_message(tpb.MESSAGE_ROLE_USER, "x" * 100_000))
        package = tmp_path / "op"
        await build_snapshot(sources.reader, await sources.cuts("a"), package, version=1, disk_reserve_bytes=0)
    snapshot = package / "snapshot"
    tree = {str(path).replace("/snapshot", "/staging", 1) for path in [snapshot, *snapshot.rglob("*")]}
    assert tree <= fsynced


def test_a_short_write_is_resumed_where_it_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writev = os.writev

    def short(descriptor: int, buffers: list[memoryview]) -> int:
        """Writes at most 3 bytes, as a write interrupted by a signal may."""
        return writev(descriptor, [buffers[0][:3]])

    monkeypatch.setattr(os, "writev", short)
    descriptor = os.open(tmp_path / "file", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        writer._write_all(descriptor, [b"abcdefg", b"", memoryview(b"hij"), b"k"])
    finally:
        os.close(descriptor)
    assert (tmp_path / "file").read_bytes() == b"abcdefghijk"


def test_more_pieces_than_one_writev_takes_are_all_written(tmp_path: Path) -> None:
    pieces = [f"{number}\n".encode() for number in range(3 * writer.IOV_MAX)]
    descriptor = os.open(tmp_path / "file", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        writer._write_all(descriptor, pieces)
    finally:
        os.close(descriptor)
    assert (tmp_path / "file").read_bytes() == b"".join(pieces)


def _joined_parts(pieces: list[bytes]) -> list[bytes]:
    return [b"".join(part) for part in utf8_parts(pieces)]


def test_text_parts_end_on_code_point_boundaries() -> None:
    text = ("a" * 32767 + "€" + "🙂" * 10000).encode()
    parts = _joined_parts([text])
    assert b"".join(parts) == text
    assert all(0 < len(part) <= 32 * 1024 for part in parts)
    assert parts[0] == b"a" * 32767  # the euro sign (3 bytes) would have crossed the limit
    assert [part.decode() for part in parts]
    assert _joined_parts([b""]) == [b""] and _joined_parts([]) == [b""]
    # Parts are views of the pieces (nothing copied).
    assert all(isinstance(view, memoryview) for part in utf8_parts([text]) for view in part)
    # The same text in pieces (each valid UTF-8) is cut at the same places, across the pieces' edges.
    pieces = [b"a" * 32000, b"\n", ("€" * 300).encode(), b"", ("🙂" * 9000).encode(), b"b" * 32768, b"\n"]
    assert _joined_parts(pieces) == _joined_parts([b"".join(pieces)])
    exact = [b"x" * 32768, b"y" * 32768]
    assert _joined_parts(exact) == exact


def _canonical(value: object) -> bytes:
    """Canonical JSON spelled with the standard library, independently of the code under test."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def test_a_message_version_and_raw_record_are_the_canonical_json_of_what_it_says() -> None:
    message = tpb.Message(
        message_id=7,
        session_id="s",
        role=tpb.MESSAGE_ROLE_TOOL,
        status=tpb.MESSAGE_STATUS_COMPLETE,
        tool_call_id="call-1",
        result_truncated=True,
        content=[
            tpb.ContentPart(text='quote " backslash \\ newline \n tab \t euro € emoji 🙂 control \x00 \x01'),
            tpb.ContentPart(attachment=tpb.AttachmentReference(attachment_id="att-1", media_type="image/png")),
        ],
    )
    # NUL bytes are escaped everywhere in canonical JSON (the record is assembled around its content).
    message.metadata.update({"usage": {"tokens": 3}, "exit": {"code": 1, "signal": None}, "note": "nul \x00"})
    record = prepare_message(message, "root")
    content = [
        {"text": message.content[0].text},
        {"attachment": {"attachmentId": "att-1", "mediaType": "image/png"}},
    ]
    said = {
        "role": "TOOL",
        "content": content,
        "toolCalls": [],
        "toolCallId": "call-1",
        "status": "COMPLETE",
        "metadata": {"exit": {"code": 1.0, "signal": None}, "note": "nul \x00"},
    }
    version = hashlib.sha256(_canonical(said)).hexdigest()
    origin = {"kind": "message", "sessionId": "s", "recordId": "7", "version": version}
    ref = hashlib.sha256(_canonical({"kind": "message", "sessionId": "s", "recordId": "7", "version": version}))
    assert record.origin == origin
    assert record.record_ref == ref.hexdigest()
    raw = {
        "recordRef": ref.hexdigest(),
        "origin": origin,
        "rootSessionId": "root",
        "createdAt": "",
        "message": {**said, "metadata": {"usage": {"tokens": 3.0}, "exit": {"code": 1.0, "signal": None},
                                         "note": "nul \x00"},
                    "resultTruncated": True},
    }  # fmt: skip
    assert b"".join(record.raw) == _canonical(raw)


async def test_a_history_rewritten_after_the_cut_is_not_spliced(tmp_path: Path, database_url: str) -> None:
    async with running_sources(tmp_path, database_url) as sources:
        await sources.session("a")
        ids = await sources.append(
            "a", text_message(tpb.MESSAGE_ROLE_USER, "one"), text_message(tpb.MESSAGE_ROLE_ASSISTANT, "two")
        )
        cuts = await sources.cuts("a")
        await sources.client.stub.EditUserMessage(
            api.EditUserMessageRequest(session_id="a", message_id=ids[0], content=[tpb.ContentPart(text="uno")]),
            metadata=sources.user,
        )
        with pytest.raises(SourceChanged) as changed:
            await build_snapshot(sources.reader, cuts, tmp_path / "op", version=1, disk_reserve_bytes=0)
        assert changed.value.session_id == "a"
        assert not (tmp_path / "op" / "snapshot").exists()

        sealed = await build_snapshot(
            sources.reader, await sources.cuts("a"), tmp_path / "op", version=2, disk_reserve_bytes=0
        )
    assert sealed.record_count == 2  # the session and the edited message: the cut after the edit


def test_free_memory_is_handed_back_once_resident_memory_grew_past_the_slack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    resident = [100 * MIB]
    trims: list[int] = []
    monkeypatch.setattr(writer, "resident_bytes", lambda: resident[0])
    monkeypatch.setattr(writer, "release_free_memory", lambda: trims.append(resident[0]))
    package = writer.PackageWriter(tmp_path / "staging", 0)
    try:
        package.add_records([])
        resident[0] += writer.TRIM_SLACK_BYTES
        package.add_records([])
        assert trims == []
        resident[0] += 1
        package.add_records([])
        assert trims == [100 * MIB + writer.TRIM_SLACK_BYTES + 1]
        # The level is measured again after the trim: the slack counts from there.
        package.add_records([])
        assert len(trims) == 1
        # Without /proc/self/statm every batch is followed by a trim.
        resident[0] = 0
        package.add_records([])
        package.add_records([])
        assert len(trims) == 3
    finally:
        package.close()
