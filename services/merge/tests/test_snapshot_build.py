"""Sealing a snapshot from a real transcript (SQLite and PostgreSQL): trees up to the cut, raw and text
projections, attachments' original bytes, hashes, verification, gaps, dedupe and repeat merges."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import struct_pb2
from snapshot_testing import Sources, message_refs, record_texts, rows, running_sources, text_message
from sqlalchemy import text

from continuum.transcript.v1 import resources_pb2 as tpb
from continuum_merge.snapshot import (
    PackageDamaged,
    SourceMissing,
    SourceUnavailable,
    TranscriptSourceReader,
    build_snapshot,
    verify_snapshot,
)
from continuum_merge.snapshot.records import canonical, sha256_hex
from continuum_runtime.database import Database

USER = tpb.MESSAGE_ROLE_USER
ASSISTANT = tpb.MESSAGE_ROLE_ASSISTANT
TOOL = tpb.MESSAGE_ROLE_TOOL
GIB = 1024**3
PNG = bytes(range(256)) * 1000


async def _two_trees(sources: Sources) -> dict[str, list[int]]:
    """Root a with a subtask child a1 (tool call, result, attachment), root b with one turn."""
    await sources.session("a")
    await sources.session("a1", parent="a", kind=tpb.SESSION_KIND_SUBTASK)
    await sources.session("b")
    attachment = await sources.upload("a", PNG)
    a = await sources.append(
        "a",
        text_message(USER, "plan the refactor"),
        tpb.NewMessage(
            role=ASSISTANT,
            content=[
                tpb.ContentPart(text="reading"),
                tpb.ContentPart(attachment=tpb.AttachmentReference(attachment_id=attachment)),
            ],
            tool_calls=[tpb.ToolCall(tool_call_id="c1", name="shell", arguments='{"cmd": "ls"}')],
        ),
        text_message(TOOL, "README.md\nsrc/", tool_call_id="c1"),
    )  # fmt: skip
    a1 = await sources.append("a1", text_message(USER, "subtask: count files"), text_message(ASSISTANT, "2 files"))
    b = await sources.append("b", text_message(USER, "fix the bug"), text_message(ASSISTANT, "fixed"))
    return {"a": a, "a1": a1, "b": b}


async def test_seals_every_tree_up_to_its_cut_and_verifies(tmp_path: Path, database_url: str) -> None:
    async with running_sources(tmp_path, database_url) as sources:
        written = await _two_trees(sources)
        cuts = await sources.cuts("a", "b")
        assert cuts[0].session_ids == ("a", "a1")
        assert cuts[0].last_message_ids == {"a": written["a"][-1], "a1": written["a1"][-1]}
        # After the cut (in the real flow the claims prevent this; here it proves the cut is honoured).
        late = await sources.append("a", text_message(USER, "after the cut"))
        package = tmp_path / "packages" / "op-1"

        sealed = await build_snapshot(sources.reader, cuts, package, version=1, disk_reserve_bytes=0)

    assert sealed == verify_snapshot(package)
    assert not (package / "staging").exists()
    assert sealed.blocking_record_refs == ()
    records = rows(package, "records.jsonl")
    assert sealed.record_count == len(records) == 3 + 7  # three sessions and seven messages
    assert message_refs(package, "a").keys() == set(written["a"])
    assert late[0] not in message_refs(package, "a")
    assert message_refs(package, "a1").keys() == set(written["a1"])
    assert message_refs(package, "b").keys() == set(written["b"])
    manifest = json.loads((package / "snapshot" / "manifest.json").read_bytes())
    assert manifest["operationId"] == "op-1"
    assert [source["rootSessionId"] for source in manifest["sources"]] == ["a", "b"]
    seal = json.loads((package / "snapshot" / "seal.json").read_bytes())
    assert (
        seal["manifestHash"]
        == sealed.snapshot_hash
        == sha256_hex((package / "snapshot" / "manifest.json").read_bytes())
    )

    assistant_ref = message_refs(package, "a")[written["a"][1]]
    raw = json.loads((package / "snapshot" / "raw" / f"{assistant_ref}.json").read_bytes())
    assert raw["origin"] == {
        "kind": "message",
        "sessionId": "a",
        "recordId": str(written["a"][1]),
        "version": raw["origin"]["version"],
    }
    assert raw["message"]["toolCalls"] == [{"toolCallId": "c1", "name": "shell", "arguments": '{"cmd": "ls"}'}]
    assert raw["rootSessionId"] == "a"
    text = b"".join(record_texts(package, assistant_ref)).decode()
    assert "reading" in text and "[tool call c1 shell]" in text and '{"cmd": "ls"}' in text
    assets = [row for row in rows(package, "files.jsonl") if row["kind"] == "asset"]
    assert len(assets) == 1 and assets[0]["recordRef"] == assistant_ref and assets[0]["part"] == 1
    assert (package / "snapshot" / assets[0]["path"]).read_bytes() == PNG
    assert assets[0]["sha256"] == sha256_hex(PNG)
    assert rows(package, "gaps.jsonl") == [] and rows(package, "occurrences.jsonl") == []
    child = next(row for row in records if row["origin"] == {**row["origin"], "kind": "session", "sessionId": "a1"})
    assert child["processingPolicy"] == "reference"
    assert all(row["processingPolicy"] == "extract" for row in records if row["origin"]["kind"] == "message")


async def test_long_text_is_cut_into_utf8_parts_and_edit_diff_display_is_left_out(
    tmp_path: Path, database_url: str
) -> None:
    long_text = ("héllo wörld 🙂 " * 7000) + "end"
    edit_metadata = {"schema": "edit-diff/v1", "structuredResult": {"hunks": ["DISPLAY-ONLY"]}, "path": "src/x.py"}
    async with running_sources(tmp_path, database_url) as sources:
        await sources.session("a")
        call = tpb.ToolCall(tool_call_id="e1", name="edit", arguments="{}")
        ids = await sources.append(
            "a",
            text_message(USER, long_text),
            tpb.NewMessage(role=ASSISTANT, tool_calls=[call]),
            text_message(TOOL, "edited src/x.py", tool_call_id="e1", metadata=_struct(edit_metadata)),
        )
        package = tmp_path / "op"
        await build_snapshot(sources.reader, await sources.cuts("a"), package, version=1, disk_reserve_bytes=0)

    refs = message_refs(package, "a")
    parts = record_texts(package, refs[ids[0]])
    assert len(parts) > 3
    assert all(len(part) <= 32 * 1024 for part in parts)
    assert all(part.decode() for part in parts)  # each part is valid UTF-8 by itself
    assert long_text in b"".join(parts).decode()
    tool_text = b"".join(record_texts(package, refs[ids[2]])).decode()
    assert "DISPLAY-ONLY" not in tool_text and "src/x.py" in tool_text
    raw = json.loads((package / "snapshot" / "raw" / f"{refs[ids[2]]}.json").read_bytes())
    assert raw["message"]["metadata"]["structuredResult"] == {"hunks": ["DISPLAY-ONLY"]}


def _struct(value: dict[str, Any]) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    struct.update(value)
    return struct


async def test_missing_child_and_attachment_bytes_are_gaps_and_a_missing_root_refuses(
    tmp_path: Path, database_url: str
) -> None:
    async with running_sources(tmp_path, database_url) as sources:
        await _two_trees(sources)
        cuts = await sources.cuts("a", "b")
        await sources.delete("a1")
        for stored in (tmp_path / "data" / "attachments").rglob("*"):
            if stored.is_file():
                stored.unlink()
        package = tmp_path / "op"
        sealed = await build_snapshot(sources.reader, cuts, package, version=1, disk_reserve_bytes=0)
        gaps = rows(package, "gaps.jsonl")
        assert sorted(gap["kind"] for gap in gaps) == ["attachment_missing", "session_missing"]
        assert sealed == verify_snapshot(package)
        assert not list((package / "snapshot" / "assets").iterdir())

        await sources.delete("b")
        with pytest.raises(SourceMissing) as missing:
            await build_snapshot(sources.reader, cuts, package, version=2, disk_reserve_bytes=0)
        assert missing.value.session_id == "b"
    assert verify_snapshot(package).version == 1  # the unrecorded attempt left the sealed one alone


async def test_repeat_merge_keeps_originals_and_folds_duplicates(tmp_path: Path, database_url: str) -> None:
    """C = merge(A, B); then merge(C, A) after A chatted on and B was deleted."""
    async with running_sources(tmp_path, database_url) as sources:
        written = await _two_trees(sources)
        first = tmp_path / "packages" / "op-1"
        await build_snapshot(sources.reader, await sources.cuts("a", "b"), first, version=1, disk_reserve_bytes=0)
        await sources.session("c", kind=tpb.SESSION_KIND_MERGED, metadata={"sessionMergeOperationId": "op-1"})
        c_ids = await sources.append("c", text_message(ASSISTANT, "handoff entry"), text_message(USER, "go on"))
        a_new = await sources.append("a", text_message(USER, "new in a"))
        await sources.delete("b")
        second = tmp_path / "packages" / "op-2"

        sealed = await build_snapshot(
            sources.reader, await sources.cuts("c", "a"), second, version=1, disk_reserve_bytes=0
        )

    assert sealed == verify_snapshot(second)
    first_refs = {row["recordRef"] for row in rows(first, "records.jsonl")}
    second_records = rows(second, "records.jsonl")
    second_refs = [row["recordRef"] for row in second_records]
    assert len(second_refs) == len(set(second_refs))  # one record per identity and version
    assert first_refs <= set(second_refs)  # every original, b's included, from op-1's package
    assert message_refs(second, "b").keys() == set(written["b"])
    assert message_refs(second, "c").keys() == set(c_ids)
    assert message_refs(second, "a").keys() == {*written["a"], *a_new}
    occurrences = rows(second, "occurrences.jsonl")
    folded = {row["recordRef"] for row in occurrences if row.get("sessionId") in ("a", "a1")}
    # a's tree as op-1 sealed it is read again directly: its messages and a1 (whose cut did not move)
    # are occurrences; a itself, cut later, is a second version of its session record.
    first_tree = [row for row in rows(first, "records.jsonl") if row["origin"]["sessionId"] in ("a", "a1")]
    assert folded == {row["recordRef"] for row in first_tree if row["origin"]["recordId"] != "a"}
    a_versions = [
        row for row in second_records if row["origin"] == {**row["origin"], "kind": "session", "recordId": "a"}
    ]
    assert len(a_versions) == 2
    # The attachment came over from op-1's package, bytes intact.
    assets = [row for row in rows(second, "files.jsonl") if row["kind"] == "asset"]
    assert {row["sha256"] for row in assets} == {sha256_hex(PNG)}
    # Nothing of the second package points into the first.
    assert all(not path.is_symlink() for path in (second / "snapshot").rglob("*"))


async def test_verify_finds_every_kind_of_damage(tmp_path: Path, database_url: str) -> None:
    async with running_sources(tmp_path, database_url) as sources:
        await _two_trees(sources)
        cuts = await sources.cuts("a", "b")
        package = tmp_path / "op"
        for damage in ("altered", "removed", "stray", "symlink", "manifest", "directory", "malformed"):
            await build_snapshot(sources.reader, cuts, package, version=1, disk_reserve_bytes=0)
            snapshot = package / "snapshot"
            text_file = next((snapshot / "text").iterdir())
            if damage == "altered":
                text_file.write_bytes(text_file.read_bytes() + b"x")
            elif damage == "removed":
                text_file.unlink()
            elif damage == "stray":
                (snapshot / "raw" / ("0" * 64 + ".json")).write_bytes(b"{}")
            elif damage == "directory":
                shutil.rmtree(snapshot / "assets")
            elif damage == "malformed":
                (snapshot / "seal.json").write_bytes(b'{"format": 1, "manifestHash": []}')
            elif damage == "symlink":
                text_file.unlink()
                text_file.symlink_to(next((snapshot / "raw").iterdir()))
            else:
                manifest = snapshot / "manifest.json"
                manifest.write_bytes(manifest.read_bytes().replace(b'"version": 1', b'"version": 2'))
            with pytest.raises(PackageDamaged):
                verify_snapshot(package)


async def test_another_users_session_is_a_missing_source(tmp_path: Path, database_url: str) -> None:
    """The reader acts for the operation's user: another user's session is never read."""
    async with running_sources(tmp_path, database_url) as sources:
        await sources.session("a")
        await sources.append("a", text_message(USER, "private"))
        other = TranscriptSourceReader(sources.client.stub, sources.client.as_user("mallory"), 30.0)
        with pytest.raises(SourceMissing):
            await build_snapshot(other, await sources.cuts("a"), tmp_path / "op", version=1, disk_reserve_bytes=0)
    assert not (tmp_path / "op" / "snapshot").exists()


async def test_a_merged_source_whose_package_is_gone_is_a_gap_and_a_damaged_one_refuses(
    tmp_path: Path, database_url: str
) -> None:
    async with running_sources(tmp_path, database_url) as sources:
        await _two_trees(sources)
        first = tmp_path / "packages" / "op-1"
        await build_snapshot(sources.reader, await sources.cuts("a"), first, version=1, disk_reserve_bytes=0)
        await sources.session("c", kind=tpb.SESSION_KIND_MERGED, metadata={"sessionMergeOperationId": "op-1"})
        await sources.append("c", text_message(ASSISTANT, "handoff entry"))
        await sources.session("d", kind=tpb.SESSION_KIND_MERGED, metadata={"sessionMergeOperationId": "op-gone"})
        await sources.session("e", kind=tpb.SESSION_KIND_MERGED, metadata={"sessionMergeOperationId": "../op-1"})
        second = tmp_path / "packages" / "op-2"

        sealed = await build_snapshot(
            sources.reader, await sources.cuts("d", "e"), second, version=1, disk_reserve_bytes=0
        )
        assert sealed.record_count == 2  # the two sessions; nothing read outside the package root's own ids
        gaps = rows(second, "gaps.jsonl")
        assert [(gap["kind"], gap["sessionId"]) for gap in gaps] == [
            ("prior_package_missing", "d"),
            ("prior_package_invalid", "e"),
        ]

        text_file = next((first / "snapshot" / "text").iterdir())
        text_file.write_bytes(b"tampered")
        with pytest.raises(PackageDamaged):
            await build_snapshot(sources.reader, await sources.cuts("c"), second, version=2, disk_reserve_bytes=0)
    assert verify_snapshot(second).version == 1


async def test_transcript_down_is_unavailable_not_missing(tmp_path: Path, database_url: str) -> None:
    async with running_sources(tmp_path, database_url) as sources:
        await sources.session("a")
        cuts = await sources.cuts("a")
        await sources.client.service.stop(grace=0)
        with pytest.raises(SourceUnavailable):
            await build_snapshot(sources.reader, cuts, tmp_path / "op", version=1, disk_reserve_bytes=0)


def _mark_blocked(package: Path, record_ref: str) -> None:
    """Stage what a merge that met an unreadable record leaves: the record listed as blocked, the
    manifest and seal rewritten to match (as that merge's seal would have written them)."""
    snapshot = package / "snapshot"
    records = rows(package, "records.jsonl")
    lines = [
        canonical({**row, "processingPolicy": "blocked"} if row["recordRef"] == record_ref else row) + b"\n"
        for row in records
    ]
    (snapshot / "records.jsonl").write_bytes(b"".join(lines))
    manifest = json.loads((snapshot / "manifest.json").read_bytes())
    data = b"".join(lines)
    manifest["streams"]["records.jsonl"] = {"sha256": sha256_hex(data), "count": len(lines), "bytes": len(data)}
    manifest["blockingRecordRefs"] = [record_ref]
    manifest_bytes = json.dumps(manifest).encode()
    (snapshot / "manifest.json").write_bytes(manifest_bytes)
    seal = {"format": manifest["format"], "version": manifest["version"], "manifestHash": sha256_hex(manifest_bytes)}
    (snapshot / "seal.json").write_bytes(canonical(seal))


async def test_a_blocked_record_of_an_earlier_package_stays_blocked(tmp_path: Path, database_url: str) -> None:
    async with running_sources(tmp_path, database_url) as sources:
        written = await _two_trees(sources)
        first = tmp_path / "packages" / "op-1"
        await build_snapshot(sources.reader, await sources.cuts("b"), first, version=1, disk_reserve_bytes=0)
        blocked = message_refs(first, "b")[written["b"][0]]
        _mark_blocked(first, blocked)
        assert verify_snapshot(first).blocking_record_refs == (blocked,)
        await sources.session("c", kind=tpb.SESSION_KIND_MERGED, metadata={"sessionMergeOperationId": "op-1"})
        second = tmp_path / "packages" / "op-2"

        sealed = await build_snapshot(
            sources.reader, await sources.cuts("c", "a"), second, version=1, disk_reserve_bytes=0
        )
    assert sealed.blocking_record_refs == (blocked,)
    assert verify_snapshot(second).blocking_record_refs == (blocked,)
    assert (second / "snapshot" / "raw" / f"{blocked}.json").read_bytes() == (
        first / "snapshot" / "raw" / f"{blocked}.json"
    ).read_bytes()


async def test_a_saved_message_this_merge_cannot_read_is_kept_raw_and_blocks(tmp_path: Path, database_url: str) -> None:
    """Seed 000 §4.2: saved but unreadable is blocking. A row a newer transcript wrote (a role this build
    does not know) is sealed with its raw record, marked blocked, and named in blockingRecordRefs; its
    neighbours are ordinary records."""
    async with running_sources(tmp_path, database_url) as sources:
        await sources.session("a")
        first, odd, last = await sources.append(
            "a", text_message(USER, "before"), text_message(ASSISTANT, "from the future"), text_message(USER, "after")
        )
        settings = sources.client.settings
        database = Database(settings.resolved_database_url("transcript"), schema="transcript")
        try:
            async with database.transaction() as connection:
                await connection.execute(text("UPDATE messages SET role = 99 WHERE message_id = :id"), {"id": odd})
        finally:
            await database.dispose()
        cuts = await sources.cuts("a")
        package = tmp_path / "packages" / "op-1"
        sealed = await build_snapshot(sources.reader, cuts, package, version=1, disk_reserve_bytes=0)

    refs = message_refs(package, "a")
    assert sealed.blocking_record_refs == (refs[odd],)
    assert verify_snapshot(package).blocking_record_refs == (refs[odd],)
    policies = {row["recordRef"]: row["processingPolicy"] for row in rows(package, "records.jsonl")}
    assert policies[refs[odd]] == "blocked"
    assert policies[refs[first]] == policies[refs[last]] == "extract"
    raw = json.loads((package / "snapshot" / "raw" / f"{refs[odd]}.json").read_bytes())
    assert raw["message"]["role"] == "99"
    assert raw["message"]["content"] == [{"text": "from the future"}]
    assert "role 99 is unknown" in raw["unreadable"]
    assert b"from the future" not in b"".join(record_texts(package, refs[odd]))
