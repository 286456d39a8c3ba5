"""End to end through the real stages: transcript and merge servers on each backend, the offline provider,
the real snapshot package, extraction units, the handoff and the published target."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import pytest
from deadline_testing import eventually
from merge_testing import MergeStack, merge_settings, running_merge, running_merge_service
from model_server_testing import MODEL, FakeModelServer, Reply
from snapshot_testing import Sources
from sqlalchemy import select
from stages_testing import FAST, Hold, attempts, merged_sessions, two_sources
from transcript_testing import all_messages, append, running_transcript, user

from continuum.merge.v1 import error_code_pb2
from continuum.merge.v1 import merge_service_pb2 as api
from continuum.merge.v1 import resources_pb2 as pb
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as tapi
from continuum_merge import store
from continuum_merge.admission import TreeCut
from continuum_merge.extraction import (
    AnswerInvalid,
    AttachmentUnreadable,
    ExtractionSettings,
    HandoffDamaged,
    PackageUnreadable,
    StorageShort,
    UnitTooLarge,
    verify_handoff,
)
from continuum_merge.pipeline import Sealed, StageStop
from continuum_merge.server import open_transcript
from continuum_merge.snapshot import (
    DiskReserveShort,
    PackageDamaged,
    RecordRequiresHandling,
    SourceChanged,
    SourceMissing,
    SourceUnavailable,
    TranscriptSourceReader,
    verify_snapshot,
)
from continuum_merge.stages import MergeStages, model_stop, snapshot_stop
from continuum_merge.tables import session_merge_units
from continuum_merge.transcript_client import TranscriptClient as MergeTranscript
from continuum_merge.worker import UNIT_BEFORE_COMMIT
from continuum_runtime.provider import (
    OfflineProvider,
    ProviderAuthFailed,
    ProviderInputTooLarge,
    ProviderRateLimited,
    ProviderSettings,
    ProviderUnavailable,
)


async def completed(stack: MergeStack, operation_id: str) -> pb.MergeOperation:
    async def done() -> bool:
        status = (await stack.get(operation_id)).progress.status
        assert status in (pb.MERGE_STATUS_PREPARING, pb.MERGE_STATUS_COMPLETED), await stack.get(operation_id)
        return status == pb.MERGE_STATUS_COMPLETED

    await eventually(done, what="the merge to complete", seconds=60)
    return await stack.get(operation_id)


def package_of(stack: MergeStack, operation_id: str) -> Path:
    return stack.settings.resolved_package_root() / operation_id


def records(package: Path) -> list[dict[str, object]]:
    lines = (package / "snapshot" / "records.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def raw_texts(package: Path) -> Counter[str]:
    """How many raw records of the package carry each text part (messages only)."""
    found: Counter[str] = Counter()
    for path in (package / "snapshot" / "raw").iterdir():
        raw = json.loads(path.read_text())
        for part in raw.get("message", {}).get("content", []):
            if "text" in part:
                found[part["text"]] += 1
    return found


@pytest.fixture
def hold() -> Hold:
    return Hold(UNIT_BEFORE_COMMIT)


@pytest.fixture
async def stack(tmp_path: Path, database_url: str, hold: Hold) -> AsyncIterator[MergeStack]:
    async with running_merge(tmp_path, database_url, failpoint=hold, overrides=FAST) as started:
        yield started


async def test_two_sources_with_tool_rounds_publish_a_merged_target_and_free_the_sources_at_the_seal(
    stack: MergeStack, hold: Hold
) -> None:
    await two_sources(stack.transcript)
    picture = b"\x89PNG picture bytes " * 5000
    sources = Sources(stack.transcript, TranscriptSourceReader(stack.transcript.stub, stack.user(), 30))
    attachment_id = await sources.upload("a", picture)
    shown = tpb.ContentPart(attachment=tpb.AttachmentReference(attachment_id=attachment_id))
    await append(stack.transcript, "a", tpb.NewMessage(role=tpb.MESSAGE_ROLE_USER, content=[shown]))
    start = await stack.start(["a", "b"], title="Merged work")
    operation_id = start.operation.progress.operation_id
    await asyncio.wait_for(hold.reached.wait(), 60)

    # Extraction runs: the claims are gone, so the sources chat again and can even be deleted.
    await append(stack.transcript, "a", user("a: after the seal"))
    await stack.run_claim("a")
    await stack.transcript.stub.DeleteSession(tapi.DeleteSessionRequest(session_id="b"), metadata=stack.user())
    current = await stack.get(operation_id)
    assert current.progress.snapshot_sealed and not current.progress.locked_source_session_ids
    hold.release.set()

    operation = await completed(stack, operation_id)
    target_id = operation.progress.target_session_id
    assert operation.progress.target_available
    target = (
        await stack.transcript.stub.GetSession(tapi.GetSessionRequest(session_id=target_id), metadata=stack.user())
    ).session
    assert target.kind == tpb.SESSION_KIND_MERGED and not target.parent_session_id
    assert target.metadata.fields["sessionMergeOperationId"].string_value == operation_id
    assert target.title == "Merged work"
    entry = await all_messages(stack.transcript.stub, stack.user(), target_id)
    assert len(entry) == 1 and operation_id in entry[0].content[0].text
    assert "historical reference" in entry[0].content[0].text

    # The package keeps every original, also those of the deleted source, and nothing after the cut.
    package = package_of(stack, operation_id)
    async with stack.database.connection() as connection:
        stored = await store.load(connection, operation_id)
    assert stored is not None and stored.claim_id is None
    assert verify_snapshot(package).snapshot_hash == stored.snapshot_hash
    assert verify_handoff(package).handoff_hash == stored.handoff_hash
    texts = raw_texts(package)
    for text in ("b: please look at the build", "b: the build passes now", "b-child message 0", "a message 0"):
        assert texts[text] == 1, text
    assert "a: after the seal" not in texts
    refs = [row["recordRef"] for row in records(package)]
    assert len(refs) == len(set(refs))
    assert (package / "handoff" / "handoff.md").is_file()
    assert (package / "snapshot" / "assets" / hashlib.sha256(picture).hexdigest()).read_bytes() == picture

    # Every unit ran once with the offline provider, and its call was recorded as completed.
    units, outcomes = await attempts(stack.database, operation_id)
    assert units > 1 and outcomes == Counter({"completed": units})


async def test_merging_a_merged_target_again_keeps_new_messages_and_folds_duplicates(
    stack: MergeStack, hold: Hold
) -> None:
    hold.reached.set()  # no hold in this test
    await two_sources(stack.transcript)
    first = await completed(stack, (await stack.start(["a", "b"], title="C")).operation.progress.operation_id)
    c_id = first.progress.target_session_id
    await append(stack.transcript, "a", user("a: later work"))
    await append(stack.transcript, c_id, user("c: continuing in the merged session"))

    second_start = await stack.start([c_id, "a"], key="key-2", title="D")
    second = await completed(stack, second_start.operation.progress.operation_id)
    first_package = package_of(stack, first.progress.operation_id)
    package = package_of(stack, second.progress.operation_id)
    verify_snapshot(package)

    first_refs = {str(row["recordRef"]) for row in records(first_package)}
    refs = [str(row["recordRef"]) for row in records(package)]
    assert len(refs) == len(set(refs)), "a record was copied twice"
    assert first_refs <= set(refs), "an original of the first merge is missing"
    texts = raw_texts(package)
    # a's messages arrive twice (through C's package and directly): one record each.
    for text in ("a: please look at the build", "a: the build passes now", "b: the build passes now"):
        assert texts[text] == 1, text
    assert texts["a: later work"] == 1
    assert texts["c: continuing in the merged session"] == 1
    occurrences = (package / "snapshot" / "occurrences.jsonl").read_text().splitlines()
    assert any(json.loads(line)["sessionId"] == "a" for line in occurrences)
    # The second handoff was built over the second package and the target is its own root.
    assert verify_handoff(package).snapshot_hash == verify_snapshot(package).snapshot_hash
    target = (
        await stack.transcript.stub.GetSession(
            tapi.GetSessionRequest(session_id=second.progress.target_session_id), metadata=stack.user()
        )
    ).session
    assert target.metadata.fields["sessionMergeOperationId"].string_value == second.progress.operation_id


async def paused(stack: MergeStack, operation_id: str) -> pb.MergeOperation:
    async def stopped() -> bool:
        return (await stack.get(operation_id)).progress.status == pb.MERGE_STATUS_PAUSED

    await eventually(stopped, what="the merge to pause", seconds=60)
    return await stack.get(operation_id)


async def test_disk_short_of_the_reserve_pauses_resumably_with_every_source_free(
    tmp_path: Path, database_url: str
) -> None:
    async with running_merge(tmp_path, database_url, overrides={**FAST, "disk_reserve_bytes": 2**62}) as stack:
        await two_sources(stack.transcript)
        operation_id = (await stack.start(["a", "b"])).operation.progress.operation_id
        operation = await paused(stack, operation_id)
        progress = operation.progress
        assert progress.error_code == error_code_pb2.DISK_RESERVE and progress.can_resume
        assert not progress.snapshot_sealed and not progress.locked_source_session_ids
        await stack.run_claim("a")


@pytest.mark.parametrize("repaired", [True, False], ids=["restored-then-resumed", "resumed-still-damaged"])
async def test_a_text_part_altered_after_the_seal_pauses_package_damaged(
    stack: MergeStack, hold: Hold, repaired: bool
) -> None:
    """Seed 000 §6.3: a hash mismatch pauses for diagnosis; failed only once confirmed unrecoverable,
    i.e. a resume finds the package still damaged (the sources were released at the seal)."""
    await two_sources(stack.transcript)
    operation_id = (await stack.start(["a", "b"])).operation.progress.operation_id
    await asyncio.wait_for(hold.reached.wait(), 60)
    # Every text part is altered while the first unit waits to commit: the next unit reads one.
    originals = {}
    for part in (package_of(stack, operation_id) / "snapshot" / "text").iterdir():
        originals[part] = part.read_bytes()
        part.write_bytes(originals[part] + b"tampered")
    hold.release.set()
    operation = await paused(stack, operation_id)
    progress = operation.progress
    assert progress.error_code == error_code_pb2.PACKAGE_DAMAGED and progress.snapshot_sealed
    assert progress.can_resume
    assert progress.target_session_id not in {session.session_id for session in await merged_sessions(stack.transcript)}

    if repaired:
        # The diagnosis found the cause and the operator restored the files: the merge goes on.
        for part, data in originals.items():
            part.write_bytes(data)
    await stack.stub.ResumeMerge(
        api.ResumeMergeRequest(operation_id=operation_id, expected_epoch=progress.run_epoch), metadata=stack.user()
    )

    async def settled() -> bool:
        status = (await stack.get(operation_id)).progress.status
        return status in (pb.MERGE_STATUS_COMPLETED, pb.MERGE_STATUS_FAILED)

    await eventually(settled, what="the resumed merge to settle", seconds=90)
    progress = (await stack.get(operation_id)).progress
    if repaired:
        assert progress.status == pb.MERGE_STATUS_COMPLETED, progress
        return
    assert progress.status == pb.MERGE_STATUS_FAILED, progress
    assert progress.error_code == error_code_pb2.PACKAGE_DAMAGED
    assert "cannot be recovered" in progress.error
    assert not progress.can_resume and progress.can_cancel
    assert progress.target_session_id not in {session.session_id for session in await merged_sessions(stack.transcript)}
    await stack.stub.CancelMerge(api.CancelMergeRequest(operation_id=operation_id), metadata=stack.user())
    assert (await stack.get(operation_id)).progress.status == pb.MERGE_STATUS_CANCELLED


@pytest.mark.parametrize(
    ("error", "code", "outcome"),
    [
        (DiskReserveShort(1, 2), "DISK_RESERVE", "paused"),
        (RecordRequiresHandling(("r",)), "RECORD_REQUIRES_HANDLING", "paused"),
        (SourceMissing("a"), "SOURCE_MISSING", "failed"),
        (SourceChanged("a", "attachment"), "SOURCE_BUSY", "paused"),
        (SourceUnavailable("down"), "SOURCE_BUSY", "retry"),
        (PackageDamaged("p", "seal"), "PACKAGE_DAMAGED", "paused"),
    ],
)
def test_snapshot_failures_map_to_a_code_and_an_outcome(error: Exception, code: str, outcome: str) -> None:
    stop = snapshot_stop(error)
    assert (stop.code, stop.outcome) == (code, outcome)


@pytest.mark.parametrize(
    ("error", "code", "outcome"),
    [
        # The attempts and backoff were spent on the call already: paused, resumable (issue 10).
        (ProviderUnavailable("down"), "PROVIDER_UNAVAILABLE", "paused"),
        (ProviderRateLimited("429"), "PROVIDER_UNAVAILABLE", "paused"),
        (ProviderAuthFailed("401"), "PROVIDER_UNAVAILABLE", "paused"),
        (ProviderInputTooLarge("413"), "PROVIDER_UNAVAILABLE", "paused"),
        (UnitTooLarge("big", unit_id="u"), "PROVIDER_UNAVAILABLE", "paused"),
        (AnswerInvalid("bad", unit_id="u"), "PROVIDER_UNAVAILABLE", "paused"),
        (PackageUnreadable("gone"), "PACKAGE_DAMAGED", "paused"),
        (HandoffDamaged("gone"), "PACKAGE_DAMAGED", "paused"),
        (StorageShort("work/u.json", "ENOSPC"), "DISK_RESERVE", "paused"),
        (AttachmentUnreadable("r", ("application/zip",)), "RECORD_REQUIRES_HANDLING", "paused"),
    ],
)
def test_model_failures_map_to_a_code_and_an_outcome(error: Exception, code: str, outcome: str) -> None:
    stop = model_stop(error)
    assert (stop.code, stop.outcome) == (code, outcome)


@pytest.fixture
async def model_server() -> AsyncIterator[FakeModelServer]:
    fake = FakeModelServer()
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()


def http_provider(model_server: FakeModelServer) -> ProviderSettings:
    return ProviderSettings(kind="openai", base_url=model_server.url, model=MODEL, max_retries=0)


async def test_a_provider_without_answers_is_tried_three_times_then_pauses_resumably(
    tmp_path: Path, database_url: str, model_server: FakeModelServer
) -> None:
    """Issue 10: 3 attempts per unit and model (the waits between them are the extraction's backoff, none
    here), then paused PROVIDER_UNAVAILABLE; resuming continues."""
    model_server.script(*(Reply(status=503, body=b"overloaded") for _ in range(3)))
    overrides = {
        **FAST,
        "provider": http_provider(model_server),
        "extraction": ExtractionSettings(backoff_seconds=(0.0,)),
    }
    async with running_merge(tmp_path, database_url, overrides=overrides) as stack:
        await two_sources(stack.transcript)
        operation_id = (await stack.start(["a", "b"])).operation.progress.operation_id
        progress = (await paused(stack, operation_id)).progress
        assert progress.snapshot_sealed and progress.can_resume
        assert progress.error_code == error_code_pb2.PROVIDER_UNAVAILABLE
        assert len(model_server.requests) == 3 and {r.json()["model"] for r in model_server.requests} == {MODEL}
        _, outcomes = await attempts(stack.database, operation_id)
        assert outcomes == Counter({"error": 1})


async def test_a_provider_refusing_the_credentials_pauses_resumably(
    tmp_path: Path, database_url: str, model_server: FakeModelServer
) -> None:
    model_server.script(Reply(status=401, body=b"bad key"))
    async with running_merge(
        tmp_path, database_url, overrides={**FAST, "provider": http_provider(model_server)}
    ) as stack:
        await two_sources(stack.transcript)
        operation_id = (await stack.start(["a", "b"])).operation.progress.operation_id
        progress = (await paused(stack, operation_id)).progress
        assert progress.error_code == error_code_pb2.PROVIDER_UNAVAILABLE and progress.can_resume
        assert len(model_server.requests) == 1


class HeldSnapshot(MergeStages):
    """The real stages, with the snapshot held after the cut was recorded until the test releases it."""

    def __init__(self, transcript: MergeTranscript, hold: Hold) -> None:
        super().__init__(transcript, OfflineProvider(), timeout_seconds=30, disk_reserve_bytes=0)
        self.hold = hold

    async def snapshot(
        self, owner: str, package_dir: Path, cuts: Sequence[TreeCut], version: int, failpoint: Callable[[str], None]
    ) -> Sealed:
        await self.hold("snapshot")
        return await super().snapshot(owner, package_dir, cuts, version, failpoint)


async def test_a_history_rewritten_after_the_cut_is_not_copied(tmp_path: Path, database_url: str) -> None:
    async with running_transcript(tmp_path, database_url) as transcript:
        client = open_transcript(merge_settings(tmp_path, database_url, transcript.service.port))
        hold = Hold("snapshot")
        try:
            async with running_merge_service(
                tmp_path, database_url, transcript, pipeline=HeldSnapshot(client, hold), overrides=FAST
            ) as stack:
                await two_sources(stack.transcript)
                operation_id = (await stack.start(["a", "b"])).operation.progress.operation_id
                await asyncio.wait_for(hold.reached.wait(), 60)
                first = (await all_messages(transcript.stub, stack.user(), "a"))[0]
                await transcript.stub.EditUserMessage(
                    tapi.EditUserMessageRequest(
                        session_id="a", message_id=first.message_id, content=[tpb.ContentPart(text="a: rewritten")]
                    ),
                    metadata=stack.user(),
                )
                hold.release.set()
                progress = (await paused(stack, operation_id)).progress
                assert progress.error_code == error_code_pb2.SOURCE_BUSY and not progress.snapshot_sealed
                assert not progress.locked_source_session_ids
        finally:
            await client.close()


async def test_a_source_deleted_before_the_copy_fails_the_merge_source_missing(
    tmp_path: Path, database_url: str
) -> None:
    async with running_transcript(tmp_path, database_url) as transcript:
        client = open_transcript(merge_settings(tmp_path, database_url, transcript.service.port))
        hold = Hold("snapshot")
        try:
            async with running_merge_service(
                tmp_path, database_url, transcript, pipeline=HeldSnapshot(client, hold), overrides=FAST
            ) as stack:
                await two_sources(stack.transcript)
                operation_id = (await stack.start(["a", "b"])).operation.progress.operation_id
                await asyncio.wait_for(hold.reached.wait(), 60)
                await transcript.stub.DeleteSession(tapi.DeleteSessionRequest(session_id="b"), metadata=stack.user())
                hold.release.set()

                async def failed() -> bool:
                    return (await stack.get(operation_id)).progress.status == pb.MERGE_STATUS_FAILED

                await eventually(failed, what="the merge to fail", seconds=60)
                progress = (await stack.get(operation_id)).progress
                assert progress.error_code == error_code_pb2.SOURCE_MISSING and not progress.can_resume
                assert not progress.locked_source_session_ids
                await stack.run_claim("a")
        finally:
            await client.close()


async def test_units_over_the_request_guard_are_split_and_their_halves_complete(
    tmp_path: Path, database_url: str
) -> None:
    async with running_transcript(tmp_path, database_url) as transcript:
        client = open_transcript(merge_settings(tmp_path, database_url, transcript.service.port))
        # Two long tool outputs do not fit one request; one does.
        stages = MergeStages(
            client,
            OfflineProvider(),
            timeout_seconds=30,
            disk_reserve_bytes=0,
            # A small window keeps the margin at 1024 tokens, so a unit plans both outputs and goes over
            # the byte guard.
            extraction=ExtractionSettings(request_bytes=30_000, context_window_tokens=20_000),
        )
        try:
            async with running_merge_service(
                tmp_path, database_url, transcript, pipeline=stages, overrides=FAST
            ) as stack:
                await two_sources(stack.transcript)
                operation = await completed(stack, (await stack.start(["a", "b"])).operation.progress.operation_id)
                async with stack.database.connection() as connection:
                    states = Counter(
                        (
                            await connection.execute(
                                select(session_merge_units.c.state).where(
                                    session_merge_units.c.operation_id == operation.progress.operation_id
                                )
                            )
                        ).scalars()
                    )
                _, outcomes = await attempts(stack.database, operation.progress.operation_id)
        finally:
            await client.close()
    assert states["split"] >= 1 and set(states) == {"split", "completed"}
    assert outcomes["error"] == states["split"]
    progress = operation.progress.progress
    assert progress.completed_units == progress.known_units == states["completed"]


def test_a_stage_stop_names_a_code_of_the_contract_or_none() -> None:
    assert StageStop("PACKAGE_DAMAGED", "damaged", "paused").code == "PACKAGE_DAMAGED"
    assert StageStop("", "unexpected", "retry").code == ""
    with pytest.raises(ValueError, match="not a MergeErrorCode"):
        StageStop("PACKAGE_BROKEN", "misspelt", "paused")
