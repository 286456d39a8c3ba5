"""Planning extraction units over sealed snapshot packages built in the documented layout."""

from __future__ import annotations

import hashlib
import itertools
import json
import tracemalloc
from pathlib import Path

import pytest
from extraction_testing import SnapshotBuilder

from continuum_merge.extraction import PackageUnreadable, UnitBudget, plan_units, scan_unit, split_unit
from continuum_merge.extraction.plan import PartSpec, UnitSpec

# 384 estimated tokens of material per unit; each part costs its bytes / 4 plus 32.
SMALL = UnitBudget(
    request_tokens=2_048, output_tokens=512, safety_tokens=128, instruction_tokens=1_024, overlap_tokens=120
)


def history(package_dir: Path) -> SnapshotBuilder:
    builder = SnapshotBuilder(package_dir)
    for number in range(1, 31):
        builder.add("session-a", number, "user" if number % 2 else "assistant", f"A message {number}. " * 20)
    builder.add("session-a", 31, "assistant", "private reasoning", policy="archive")
    for number in range(1, 11):
        builder.add("session-b", number, "assistant", f"B message {number}. " * 20)
    return builder


def parts_of(package_dir: Path, units: list[UnitSpec]) -> list[tuple[list[PartSpec], list[PartSpec]]]:
    return [scan_unit(package_dir, unit) for unit in units]


def test_every_extractable_part_is_in_exactly_one_unit_in_snapshot_order(tmp_path: Path) -> None:
    builder = history(tmp_path)
    record = builder.add("session-b", 99, "user", "界面字段改名" * 6_000)  # 108,000 bytes: four parts
    builder.add_asset(record, b"\x89PNG not text")
    package = builder.seal()
    units = list(plan_units(package, processor_version="p1", budget=SMALL))
    assert len(units) > 5
    own = [part for _, parts in parts_of(package, units) for part in parts]
    files = [json.loads(line) for line in (package / "snapshot" / "files.jsonl").read_text().splitlines()]
    expected = [row["ref"] for row in files if row["kind"] == "text" and "private" not in _text(package, row)]
    # Each part once, in order; a part over the material budget as consecutive slice units.
    assert [ref for ref, _ in itertools.groupby(part.ref for part in own)] == expected
    sliced = [unit for unit in units if unit.slice is not None]
    assert {unit.first_ref for unit in sliced} == {ref for ref in expected if ref.startswith(f"r_{record}:")}
    for ref, group in itertools.groupby(sliced, key=lambda unit: unit.first_ref):
        bounds = [unit.slice for unit in group if unit.slice is not None]
        data = _text(package, next(row for row in files if row["ref"] == ref)).encode()
        # Byte ranges end to end, cut on code points, each with its bytes' hash and its UTF-16 start.
        assert bounds[0].start == 0 and bounds[-1].end == len(data)
        assert all(left.end == right.start for left, right in itertools.pairwise(bounds))
        assert all((b.end - b.start) / 4 + 32 <= SMALL.material_tokens for b in bounds)
        for piece in bounds:
            assert piece.sha256 == hashlib.sha256(data[piece.start : piece.end]).hexdigest()
            assert piece.utf16_start == len(data[: piece.start].decode().encode("utf-16-le")) // 2
    assert [unit.ordinal for unit in units] == list(range(len(units)))
    assert all(unit.stage == "extracting" and unit.part_count >= 1 for unit in units)
    # The stored input is small and, with the id and ordinal, rebuilds the unit.
    assert all(len(unit.input_json()) < 600 for unit in units)
    assert [UnitSpec.from_stored(u.unit_id, u.ordinal, u.input_json()) for u in units] == units
    with pytest.raises(ValueError, match="malformed"):
        UnitSpec.from_stored("x", 0, '{"stage": "extracting"}')
    with pytest.raises(ValueError, match="malformed"):
        UnitSpec.from_stored("x", 0, units[0].input_json().replace('"parts":', '"parts":-'))


def test_units_stay_within_the_budget_with_context_from_the_unit_before(tmp_path: Path) -> None:
    package = history(tmp_path).seal()
    units = list(plan_units(package, processor_version="p1", budget=SMALL))
    scanned = parts_of(package, units)
    for (context, own), unit in zip(scanned, units, strict=True):
        assert sum(part.tokens(SMALL) for part in [*context, *own]) <= SMALL.material_tokens or len(own) == 1
        assert len(context) == unit.context_count
    for (_, before), (context, _) in itertools.pairwise(scanned):
        assert context == before[len(before) - len(context) :]
    assert any(context for context, _ in scanned[1:])


def test_unit_ids_depend_only_on_snapshot_inputs_and_processor(tmp_path: Path) -> None:
    first = list(plan_units(history(tmp_path / "one").seal(), processor_version="p1", budget=SMALL))
    again = list(plan_units(history(tmp_path / "two").seal(), processor_version="p1", budget=SMALL))
    assert first == again
    assert len({unit.unit_id for unit in first}) == len(first)
    other = list(plan_units(tmp_path / "one", processor_version="p2", budget=SMALL))
    assert not {unit.unit_id for unit in first} & {unit.unit_id for unit in other}
    changed = history(tmp_path / "three")
    changed.add("session-b", 100, "user", "one more message")
    later = list(plan_units(changed.seal(), processor_version="p1", budget=SMALL))
    # Another snapshot is another identity, even where the inputs are the same.
    assert first[0].input_hash == later[0].input_hash and first[0].unit_id != later[0].unit_id


def test_a_tool_result_stays_with_the_call_before_it(tmp_path: Path) -> None:
    builder = SnapshotBuilder(tmp_path)
    # Each 200-byte message costs 82 estimated tokens: four fit in 384, the fifth (the result) would not.
    for number in range(1, 4):
        builder.add("s", number, "user", "u" * 200)
    builder.add("s", 4, "assistant", "calls the test runner " + "c" * 178)
    builder.add("s", 5, "tool", "result " + "r" * 193)
    builder.add("s", 6, "user", "u" * 200)
    package = builder.seal()
    units = list(plan_units(package, processor_version="p1", budget=SMALL))
    scanned = parts_of(package, units)
    roles = [[part.role for part in own] for _, own in scanned]
    assert roles[0] == ["user", "user", "user"]
    assert roles[1][:2] == ["assistant", "tool"]


def test_scan_refuses_a_unit_whose_manifest_changed_and_unsafe_or_unsealed_packages(tmp_path: Path) -> None:
    package = history(tmp_path).seal()
    units = list(plan_units(package, processor_version="p1", budget=SMALL))
    files = package / "snapshot" / "files.jsonl"
    original = files.read_text()
    files.write_text(original.replace(units[1].first_ref, units[1].first_ref[:-1] + "9"))
    with pytest.raises(PackageUnreadable, match="no longer matches"):
        scan_unit(package, units[1])
    first_row = json.loads(original.splitlines()[0])
    files.write_text(original.replace(first_row["path"], "../../etc/passwd"))
    with pytest.raises(PackageUnreadable, match="unsafe path"):
        list(plan_units(package, processor_version="p1", budget=SMALL))
    files.write_text(original)
    (package / "snapshot" / "seal.json").unlink()
    with pytest.raises(PackageUnreadable, match="not sealed"):
        list(plan_units(package, processor_version="p1", budget=SMALL))


def test_a_part_naming_a_record_out_of_order_is_a_damaged_manifest(tmp_path: Path) -> None:
    package = history(tmp_path).seal()
    files = package / "snapshot" / "files.jsonl"
    lines = files.read_text().splitlines(keepends=True)
    first, second = [number for number, line in enumerate(lines) if json.loads(line)["kind"] == "text"][:2]
    lines[first], lines[second] = lines[second], lines[first]
    files.write_text("".join(lines))
    with pytest.raises(PackageUnreadable, match="not listed"):
        list(plan_units(package, processor_version="p1", budget=SMALL))


def test_a_split_unit_is_covered_by_two_deterministic_halves_down_to_single_parts(tmp_path: Path) -> None:
    package = history(tmp_path).seal()
    units = list(plan_units(package, processor_version="p1", budget=SMALL))
    parent = next(unit for unit in units if unit.context_count and unit.part_count >= 2)
    _, own = scan_unit(package, parent)
    halves = split_unit(package, parent, floor_tokens=0)
    assert halves is not None
    first, second = halves
    assert (first.unit_id, second.unit_id) == (f"{parent.unit_id}.0", f"{parent.unit_id}.1")
    assert first.ordinal == second.ordinal == parent.ordinal
    assert first.context_count == second.context_count == 0
    assert [*scan_unit(package, first)[1], *scan_unit(package, second)[1]] == own
    assert split_unit(package, parent, floor_tokens=0) == halves
    leaves = [first, second]
    while any(unit.part_count > 1 for unit in leaves):
        leaves = [child for unit in leaves for child in (split_unit(package, unit, floor_tokens=0) or (unit,))]
    assert [scan_unit(package, unit)[1][0] for unit in leaves] == own
    # A single part at the shrink floor is not split again.
    assert split_unit(package, leaves[0]) is None
    assert sorted(unit.unit_id for unit in leaves) == [unit.unit_id for unit in leaves]
    # Above the floor, a single part is bisected into contiguous slices of its text, down to the floor.
    slices = split_unit(package, leaves[0], floor_tokens=0)
    assert slices is not None
    first_slice, second_slice = [child.slice for child in slices]
    assert first_slice is not None and second_slice is not None
    assert first_slice.start == 0 and first_slice.end == second_slice.start < second_slice.end
    assert all(child.part_count == 1 and child.context_count == 0 for child in slices)
    assert UnitSpec.from_stored(slices[1].unit_id, slices[1].ordinal, slices[1].input_json()) == slices[1]


def test_budgets_that_leave_no_room_for_material_are_refused() -> None:
    with pytest.raises(ValueError, match="less than 256"):
        UnitBudget(request_tokens=4_096, output_tokens=2_048, safety_tokens=1_024, instruction_tokens=1_024)
    with pytest.raises(ValueError, match="byte guards"):
        UnitBudget(response_bytes=0)


def _text(package: Path, row: dict[str, object]) -> str:
    return (package / "snapshot" / str(row["path"])).read_text()


def test_planning_a_long_history_streams_in_bounded_memory(tmp_path: Path) -> None:
    # 8,000 records make over 5,000 units; the plan is handed out one unit at a time, so what planning
    # holds is bounded by one unit's parts, not by the history: about 1 MiB at 2,000 records as at 8,000
    # (mostly the manifest hash's read buffer), where a list of every unit takes about 4 MiB.
    builder = SnapshotBuilder(tmp_path)
    for number in range(8_000):
        builder.add(f"session-{number % 3}", number, ("user", "assistant", "tool")[number % 3], f"step {number}. " * 40)
    package = builder.seal()
    del builder
    tracemalloc.start()
    try:
        first = next(plan_units(package, processor_version="p1", budget=SMALL))
        count = sum(1 for _ in plan_units(package, processor_version="p1", budget=SMALL))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert first.ordinal == 0 and count > 3_000
    assert peak < 2 * 1024 * 1024, f"planning {count} units peaked at {peak} traced bytes"
