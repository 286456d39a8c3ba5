"""Running extraction units with the built-in offline provider over sealed snapshot packages."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from extraction_testing import SnapshotBuilder

from continuum_merge.extraction import (
    PackageUnreadable,
    UnitBudget,
    plan_units,
    run_unit,
    scan_unit,
    split_unit,
    verify_unit_result,
)
from continuum_merge.extraction.schema import SECTIONS, STATUSES, AnswerProblem, parse_answer
from continuum_runtime.provider import OFFLINE_MODEL, OfflineProvider

# Three parts per unit at most, so eight short messages make several units.
BUDGET = UnitBudget(
    request_tokens=2_048, output_tokens=512, safety_tokens=128, instruction_tokens=1_024, overlap_tokens=40, max_parts=3
)


def continuation(package_dir: Path) -> Path:
    """The continuation sample of issue 10 in small: A renamed a field, B still reads the old one."""
    builder = SnapshotBuilder(package_dir)
    builder.add("session-a", 1, "user", "Rename the response field name to displayName. Never break old clients.")
    builder.add("session-a", 2, "assistant", "Changed api/users.py: the response now carries displayName.")
    builder.add("session-a", 3, "assistant", "$ pytest tests/test_users.py -q")
    builder.add("session-a", 4, "tool", "4 passed in 0.21s")
    builder.add("session-b", 1, "user", "Show the user's name in the header.")
    builder.add("session-b", 2, "assistant", "The header reads user.name from web/header.tsx.")
    builder.add("session-b", 3, "tool", "Error: integration test failed: name is undefined")
    builder.add("session-b", 4, "assistant", "TODO: integrate with the API once it is deployed.")
    return builder.seal()


async def test_each_unit_writes_checked_items_whose_evidence_resolves_to_its_parts(tmp_path: Path) -> None:
    package = continuation(tmp_path)
    units = list(plan_units(package, processor_version="p1", budget=BUDGET))
    assert len(units) > 1
    provider = OfflineProvider()
    seen_refs: set[str] = set()
    for unit in units:
        outcome = await run_unit(unit, package, provider, model="", budget=BUDGET)
        assert outcome.relative_path == f"work/{unit.unit_id}.json"
        assert outcome.path == package / outcome.relative_path
        data = outcome.path.read_bytes()
        assert hashlib.sha256(data).hexdigest() == outcome.sha256
        assert not list((package / "work").glob("*.tmp"))
        result = json.loads(data)
        assert result["unitId"] == unit.unit_id and result["inputHash"] == unit.input_hash
        assert result["model"] == OFFLINE_MODEL == outcome.model
        context, own = scan_unit(package, unit)
        refs = {part.ref: part for part in [*context, *own]}
        assert result["items"] and len(result["items"]) == outcome.item_count
        for item in result["items"]:
            assert item["section"] in SECTIONS and item["status"] in STATUSES and item["content"]
            assert item["itemId"].startswith("it_")
            for evidence in item["evidence"]:
                part = refs[evidence["ref"]]
                text = (package / "snapshot" / part.path).read_text()
                assert evidence["utf16"] == [0, len(text.encode("utf-16-le")) // 2]
                assert evidence["sessionId"] == part.session_id
                seen_refs.add(evidence["ref"])
        # The offline provider estimates usage: reported, one call.
        assert outcome.usage is not None and outcome.usage.prompt_tokens
        assert len(outcome.calls) == 1
    results = [json.loads(path.read_text()) for path in (package / "work").glob("*.json")]
    assert {item["status"] for result in results for item in result["items"]} == {
        "recorded",
        "unverified",
        "failed",
        "pending",
    }
    # Every part carries a line worth an item, and each was cited by the unit that owns it.
    assert len(seen_refs) == 8


async def test_a_rerun_of_a_unit_rewrites_the_same_result(tmp_path: Path) -> None:
    package = continuation(tmp_path)
    unit = next(plan_units(package, processor_version="p1", budget=BUDGET))
    first = await run_unit(unit, package, OfflineProvider(), model="", budget=BUDGET)
    (package / "work" / f"{unit.unit_id}.json.tmp").write_bytes(b"left by a crash")
    again = await run_unit(unit, package, OfflineProvider(), model="", budget=BUDGET)
    assert again.sha256 == first.sha256
    assert not (package / "work" / f"{unit.unit_id}.json.tmp").exists()


async def test_a_damaged_part_stops_the_unit_before_any_model_call(tmp_path: Path) -> None:
    package = continuation(tmp_path)
    unit = next(plan_units(package, processor_version="p1", budget=BUDGET))
    _, own = scan_unit(package, unit)
    (package / "snapshot" / own[0].path).write_text("Rename the response field to something else entirely.")
    with pytest.raises(PackageUnreadable, match="does not match its size or sha256"):
        await run_unit(unit, package, OfflineProvider(), model="", budget=BUDGET)
    (package / "snapshot" / own[0].path).unlink()
    (package / "snapshot" / own[0].path).symlink_to(package / "snapshot" / "seal.json")
    with pytest.raises(PackageUnreadable, match="unreadable"):
        await run_unit(unit, package, OfflineProvider(), model="", budget=BUDGET)
    assert not (package / "work").exists()


async def test_a_committed_result_is_reused_only_while_its_hash_matches(tmp_path: Path) -> None:
    package = continuation(tmp_path)
    unit = next(plan_units(package, processor_version="p1", budget=BUDGET))
    outcome = await run_unit(unit, package, OfflineProvider(), model="", budget=BUDGET)
    assert verify_unit_result(package, outcome.relative_path, outcome.sha256) == outcome.path
    with pytest.raises(PackageUnreadable, match="not in the work directory"):
        verify_unit_result(package, "snapshot/seal.json", outcome.sha256)
    with pytest.raises(PackageUnreadable, match="not in the work directory"):
        verify_unit_result(package, "work/../snapshot/seal.json", outcome.sha256)
    outcome.path.write_bytes(outcome.path.read_bytes() + b" ")
    with pytest.raises(PackageUnreadable, match="does not match"):
        verify_unit_result(package, outcome.relative_path, outcome.sha256)
    outcome.path.unlink()
    with pytest.raises(PackageUnreadable, match="missing"):
        verify_unit_result(package, outcome.relative_path, outcome.sha256)


async def test_a_unit_planned_over_another_snapshot_is_refused(tmp_path: Path) -> None:
    package = continuation(tmp_path)
    unit = next(plan_units(package, processor_version="p1", budget=BUDGET))
    # The same package directory sealed again with one more record: another snapshot.
    builder = SnapshotBuilder(tmp_path / "again")
    builder.add("session-a", 1, "user", "Rename the response field name to displayName. Never break old clients.")
    builder.add("session-c", 1, "user", "another source")
    resealed = builder.seal() / "snapshot"
    for name in ("manifest.json", "seal.json"):
        (package / "snapshot" / name).write_bytes((resealed / name).read_bytes())
    with pytest.raises(PackageUnreadable, match="another snapshot"):
        await run_unit(unit, package, OfflineProvider(), model="", budget=BUDGET)


def test_an_answer_citing_unknown_aliases_is_refused_quoting_only_alias_shaped_words() -> None:
    answer = json.dumps(
        {
            "schemaVersion": 2,
            "items": [{"section": "changes", "content": "x", "status": "recorded", "evidence": ["i9", "the secret"]}],
        }
    )
    with pytest.raises(AnswerProblem) as refused:
        parse_answer(answer, {"i1"})
    assert "cites 2 alias(es) this request did not give: i9" in str(refused.value)
    assert "secret" not in str(refused.value)


def bytes_read() -> int:
    """Bytes this process has read through read() calls so far (Linux /proc/self/io `rchar`)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


async def test_a_slice_of_a_large_part_reads_and_checks_only_its_own_bytes(tmp_path: Path) -> None:
    # One record of 8 MiB in a single part (a package written by another tool may hold one that large):
    # planned as slices of about 44 KiB. Running or splitting a slice reads its bytes, not the part's.
    builder = SnapshotBuilder(tmp_path, part_bytes=16 * 1024 * 1024)
    builder.add("session-a", 1, "tool", "界面字段 displayName 改名;" * 300_000)
    package = builder.seal()
    units = list(plan_units(package, processor_version="p1", budget=UnitBudget()))
    assert len(units) > 100 and all(unit.slice is not None for unit in units)
    middle = units[len(units) // 2]
    before = bytes_read()
    outcome = await run_unit(middle, package, OfflineProvider(), model="", budget=UnitBudget())
    halves = split_unit(package, middle, floor_tokens=256)
    read = bytes_read() - before
    assert outcome.item_count > 0 and halves is not None
    assert read < 1024 * 1024, f"a slice unit read {read} bytes of an 8 MiB part"
    # Its bytes are still checked: a change inside the slice is refused, one elsewhere is another unit's.
    data = bytearray((package / "snapshot" / scan_unit(package, middle)[1][0].path).read_bytes())
    assert middle.slice is not None
    data[middle.slice.start] ^= 0x01
    (package / "snapshot" / scan_unit(package, middle)[1][0].path).write_bytes(bytes(data))
    with pytest.raises(PackageUnreadable, match="slice"):
        await run_unit(middle, package, OfflineProvider(), model="", budget=UnitBudget())
