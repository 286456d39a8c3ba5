"""Fault row "disk or quota" of seed 000 §6.3 during extraction, end to end on each backend, on a real
filesystem that fills up: the package root is a small tmpfs (mounting it needs root; without it the test is
skipped, saying so). After the first unit commits, the disk is filled; the next unit's write meets a real
ENOSPC (or, with a reserve, the free space is below it) and the merge pauses with DISK_RESERVE, resumable:
the committed unit and its result stay, no partial file is left, and once space is freed a resume completes
without asking for that unit again. The aggregation meeting a full disk removes its staging directory."""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from deadline_testing import eventually
from extraction_testing import SnapshotBuilder
from merge_testing import running_merge
from stages_testing import FAST, Hold, attempts, merged_sessions, two_sources

from continuum.merge.v1 import error_code_pb2
from continuum.merge.v1 import merge_service_pb2 as api
from continuum.merge.v1 import resources_pb2 as pb
from continuum_merge.extraction import StorageShort, UnitBudget, aggregate, plan_units, run_unit, verify_handoff
from continuum_merge.worker import UNIT_AFTER_COMMIT
from continuum_runtime.provider import OfflineProvider

MIB = 1024 * 1024
DISK_BYTES = 16 * MIB
RESERVE_BYTES = 4 * MIB


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of DISK_BYTES mounted for the test's packages."""
    mount = tmp_path / "packages"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES},mode=0700", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(disk: Path, leave_bytes: int) -> Path:
    """Write a filler file until `leave_bytes` (or nothing, at ENOSPC) stay free; the filler."""
    filler = disk / "filler"
    with filler.open("wb") as stream:
        try:
            while (free := os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize) > leave_bytes:
                stream.write(b"\0" * min(MIB, max(free - leave_bytes, 4096)))
                stream.flush()
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return filler


@pytest.mark.parametrize(("reserve", "leave"), [(0, 0), (RESERVE_BYTES, RESERVE_BYTES // 2)], ids=["enospc", "reserve"])
async def test_the_disk_filling_up_during_extraction_pauses_resumably_and_keeps_committed_units(
    tmp_path: Path, database_url: str, small_disk: Path, reserve: int, leave: int
) -> None:
    hold = Hold(UNIT_AFTER_COMMIT)
    overrides = {**FAST, "package_root": small_disk, "disk_reserve_bytes": reserve}
    async with running_merge(tmp_path, database_url, failpoint=hold, overrides=overrides) as stack:
        await two_sources(stack.transcript)
        operation_id = (await stack.start(["a", "b"])).operation.progress.operation_id
        await asyncio.wait_for(hold.reached.wait(), 60)
        filler = fill(small_disk, leave)
        hold.release.set()

        async def paused() -> bool:
            return (await stack.get(operation_id)).progress.status == pb.MERGE_STATUS_PAUSED

        await eventually(paused, what="the merge to pause", seconds=60)
        progress = (await stack.get(operation_id)).progress
        assert progress.error_code == error_code_pb2.DISK_RESERVE and progress.can_resume, progress
        assert "free disk space" in progress.error and progress.snapshot_sealed
        assert not progress.locked_source_session_ids
        assert progress.progress.completed_units == 1
        work = small_disk / operation_id / "work"
        assert [path.suffix for path in work.iterdir()] == [".json"], "a partial result was left behind"
        assert not await merged_sessions(stack.transcript)

        filler.unlink()
        await stack.stub.ResumeMerge(
            api.ResumeMergeRequest(operation_id=operation_id, expected_epoch=progress.run_epoch),
            metadata=stack.user(),
        )

        async def completed() -> bool:
            return (await stack.get(operation_id)).progress.status == pb.MERGE_STATUS_COMPLETED

        await eventually(completed, what="the resumed merge to complete", seconds=60)
        units, outcomes = await attempts(stack.database, operation_id)
    # The unit committed before the disk filled was not asked again: one completed attempt per unit, and
    # the one attempt that could not write its result (or found the reserve short) ended in an error.
    assert units > 1 and outcomes == {"completed": units, "error": 1}


async def test_the_aggregation_meeting_a_full_disk_stops_and_leaves_no_staging(small_disk: Path) -> None:
    builder = SnapshotBuilder(small_disk / "op-1")
    for number in range(40):
        builder.add(f"session-{number % 2}", number, "assistant", f"Changed module {number}; tests pass. " * 20)
    package = builder.seal()
    budget = UnitBudget(request_tokens=4_096, output_tokens=512, safety_tokens=256, instruction_tokens=1_024)
    results = [
        (await run_unit(unit, package, OfflineProvider(), model="", budget=budget)).path
        for unit in plan_units(package, processor_version="p1", budget=budget)
    ]
    filler = fill(small_disk, 0)

    with pytest.raises(StorageShort, match="ENOSPC"):
        await aggregate(package, results, OfflineProvider(), model="", budget=budget, brief_tokens=256)
    assert not (package / "handoff.staging").exists() and not (package / "handoff").exists()

    filler.unlink()
    ready = await aggregate(package, results, OfflineProvider(), model="", budget=budget, brief_tokens=256)
    assert verify_handoff(package) == ready and ready.unit_count == len(results)
