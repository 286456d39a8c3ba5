"""Aggregation into handoff/ and its verification, end to end with the built-in offline provider."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from extraction_testing import SnapshotBuilder

from continuum_merge.extraction import (
    HandoffDamaged,
    HandoffReady,
    PackageUnreadable,
    UnitBudget,
    aggregate,
    plan_units,
    run_unit,
    verify_handoff,
)
from continuum_merge.extraction.schema import SECTIONS
from continuum_runtime.provider import OfflineProvider
from continuum_runtime.provider.tokens import estimate_tokens

BUDGET = UnitBudget(
    request_tokens=2_048, output_tokens=512, safety_tokens=128, instruction_tokens=1_024, overlap_tokens=40, max_parts=4
)
# Condensing packs up to 200 items per request, so the offline provider's groups fold many into one.
CONDENSE = UnitBudget(request_tokens=16_384, max_parts=200)
LINES = [
    ("user", "Rename the response field to displayName for the web client."),
    ("assistant", "Looked at the users endpoint and the callers of the old field."),
    ("assistant", "Changed api/users.py so the response carries displayName."),
    ("assistant", "$ pytest tests/test_users.py -q"),
    ("tool", "Error: test_users failed: KeyError displayName"),
    ("assistant", "TODO: retest after the fix lands."),
]


def long_history(package_dir: Path, messages: int) -> Path:
    builder = SnapshotBuilder(package_dir)
    for number in range(messages):
        role, text = LINES[number % len(LINES)]
        builder.add(f"session-{'ab'[number % 2]}", number, role, f"{text} (step {number})")
    return builder.seal()


async def extract_all(package: Path, budget: UnitBudget = BUDGET) -> list[Path]:
    provider = OfflineProvider()
    paths = []
    for unit in plan_units(package, processor_version="p1", budget=budget):
        paths.append((await run_unit(unit, package, provider, model="", budget=budget)).path)
    return paths


def read_json(path: Path) -> Any:
    return json.loads(path.read_bytes())


async def test_a_long_history_ends_in_a_verified_bounded_handoff_that_keeps_every_detail(tmp_path: Path) -> None:
    package = long_history(tmp_path, 120)
    results = await extract_all(package)
    assert len(results) > 16
    ready = await aggregate(package, results, OfflineProvider(), model="", budget=CONDENSE, brief_tokens=400)
    handoff = package / "handoff"
    assert not (package / "handoff.staging").exists()
    assert ready.handoff_hash == hashlib.sha256((handoff / "ready.json").read_bytes()).hexdigest()
    assert verify_handoff(package) == ready
    assert ready.unit_count == len(results) and ready.item_count == 120
    assert ready.layer_count >= 1 and not ready.navigation and ready.not_expanded == 0
    # Every unit's result is kept byte for byte as a detail, listed with its hash.
    rows = [json.loads(line) for line in (handoff / "details.jsonl").read_text().splitlines()]
    assert [row["unitId"] + ".json" for row in rows] == [path.name for path in results]
    for row, path in zip(rows, results, strict=True):
        assert (handoff / row["path"]).read_bytes() == path.read_bytes()
    # The brief is bounded, and each of its items leads down through the layers to detail items.
    brief = read_json(handoff / "brief.json")
    assert sum(estimate_tokens(item["content"]) for item in brief["items"]) <= 400
    layers = {
        number: {
            entry["itemId"]: entry
            for entry in map(json.loads, (handoff / f"layers/{number}.jsonl").read_text().splitlines())
        }
        for number in range(1, ready.layer_count + 1)
    }
    details = {item["itemId"] for path in results for item in read_json(path)["items"]}
    reached: set[str] = set()
    frontier = {ref for item in brief["items"] for ref in item["evidence"]}
    for number in range(ready.layer_count - 1, 0, -1):
        frontier = {ref for item_id in frontier for ref in layers[number][item_id]["evidence"]}
    reached |= frontier
    assert reached == details
    overview = read_json(handoff / "overview.json")
    assert set(overview["bySource"]) == {"session-a", "session-b"}
    assert overview["emptySections"] == ["artifacts"]
    markdown = (handoff / "handoff.md").read_text()
    assert all(f"## {section}" in markdown for section in SECTIONS)
    assert markdown.count("Not recorded.") == 1
    assert "- session-a: " in markdown and "- session-b: " in markdown


async def test_aggregating_again_gives_the_same_handoff(tmp_path: Path) -> None:
    package = long_history(tmp_path, 30)
    results = await extract_all(package)
    first = await aggregate(package, results, OfflineProvider(), model="", budget=CONDENSE, brief_tokens=400)
    (package / "handoff.staging").mkdir()
    (package / "handoff.staging" / "left-by-a-crash").write_text("x")
    again = await aggregate(package, results, OfflineProvider(), model="", budget=CONDENSE, brief_tokens=400)
    assert again == first


async def test_a_small_history_needs_no_layer_and_an_unshrinkable_one_gets_the_navigation(tmp_path: Path) -> None:
    package = long_history(tmp_path / "small", 5)
    ready = await aggregate(package, await extract_all(package), OfflineProvider(), model="", budget=BUDGET)
    assert (ready.layer_count, ready.navigation, ready.brief_item_count) == (0, False, 5)
    # Five short items in five different sections and statuses: condensing cannot make them shorter.
    package = long_history(tmp_path / "distinct", 5)
    results = await extract_all(package)
    ready = await aggregate(package, results, OfflineProvider(), model="", budget=BUDGET, brief_tokens=10)
    assert ready.navigation and ready.layer_count == 0 and ready.not_expanded == 5
    brief = read_json(package / "handoff" / "brief.json")
    assert brief["navigation"] and all(item["evidence"] == ["details.jsonl"] for item in brief["items"])
    assert "details not expanded" in (package / "handoff" / "handoff.md").read_text()
    assert verify_handoff(package) == ready


async def test_verify_refuses_a_changed_missing_or_foreign_handoff(tmp_path: Path) -> None:
    package = long_history(tmp_path, 30)
    results = await extract_all(package)
    await aggregate(package, results, OfflineProvider(), model="", budget=CONDENSE, brief_tokens=400)
    handoff = package / "handoff"
    for relative in ["brief.json", f"details/{results[0].name}", f"text/{results[1].stem}.txt", "layers/1.jsonl"]:
        original = (handoff / relative).read_bytes()
        (handoff / relative).write_bytes(original + b" ")
        with pytest.raises(HandoffDamaged, match="does not match"):
            verify_handoff(package)
        (handoff / relative).write_bytes(original)
    ready = verify_handoff(package)
    assert isinstance(ready, HandoffReady)
    # A manifest line may not point outside handoff/, even with ready.json rewritten to match it.
    details, ready_file = handoff / "details.jsonl", handoff / "ready.json"
    original, original_ready = details.read_bytes(), ready_file.read_bytes()
    row = json.loads(original.splitlines()[0])
    for outside in ["/etc/hostname", "../snapshot/seal.json"]:
        details.write_bytes(json.dumps(row | {"textPath": outside}).encode() + b"\n")
        forged = json.loads(original_ready)
        for listed in forged["files"]:
            if listed["path"] == "details.jsonl":
                listed["sha256"] = hashlib.sha256(details.read_bytes()).hexdigest()
        ready_file.write_text(json.dumps(forged))
        with pytest.raises(HandoffDamaged, match="outside handoff"):
            verify_handoff(package)
    details.write_bytes(original)
    forged = json.loads(original_ready)
    forged["files"] = [listed for listed in forged["files"] if listed["path"] != "details.jsonl"]
    ready_file.write_text(json.dumps(forged))
    with pytest.raises(HandoffDamaged, match="every entry file"):
        verify_handoff(package)
    ready_file.write_bytes(original_ready)
    # Another sealed snapshot in its place (manifest and seal agree) is not the one the handoff names.
    manifest = package / "snapshot" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes() + b"\n")
    seal = package / "snapshot" / "seal.json"
    seal.write_text(json.dumps({"manifestHash": hashlib.sha256(manifest.read_bytes()).hexdigest()}))
    with pytest.raises(HandoffDamaged, match="does not name this package's sealed snapshot"):
        verify_handoff(package)
    seal.write_text("{}")
    with pytest.raises(HandoffDamaged, match="unreadable"):
        verify_handoff(package)
    (handoff / "ready.json").unlink()
    with pytest.raises(HandoffDamaged, match="missing"):
        verify_handoff(package)


async def test_results_of_another_snapshot_or_outside_work_are_refused(tmp_path: Path) -> None:
    package = long_history(tmp_path / "one", 10)
    other = long_history(tmp_path / "two", 11)
    foreign = await extract_all(other)
    (package / "work").mkdir()
    copied = package / "work" / foreign[0].name
    copied.write_bytes(foreign[0].read_bytes())
    with pytest.raises(PackageUnreadable, match="another snapshot"):
        await aggregate(package, [copied], OfflineProvider(), model="")
    with pytest.raises(PackageUnreadable, match="work directory"):
        await aggregate(package, [foreign[0]], OfflineProvider(), model="")
    own = await extract_all(package)
    with pytest.raises(PackageUnreadable, match="given twice"):
        await aggregate(package, [own[0], own[0]], OfflineProvider(), model="")
    assert not (package / "handoff").exists()


async def test_a_history_with_nothing_to_extract_gives_an_empty_handoff_that_says_so(tmp_path: Path) -> None:
    builder = SnapshotBuilder(tmp_path)
    builder.add("session-a", 1, "assistant", "private reasoning only", policy="archive")
    package = builder.seal()
    assert list(plan_units(package, processor_version="p1", budget=BUDGET)) == []
    ready = await aggregate(package, [], OfflineProvider(), model="")
    assert (ready.unit_count, ready.item_count, ready.brief_item_count, ready.navigation) == (0, 0, 0, False)
    assert (package / "handoff" / "handoff.md").read_text().count("Not recorded.") == len(SECTIONS)
    assert verify_handoff(package) == ready
