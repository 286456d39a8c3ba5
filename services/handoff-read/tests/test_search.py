"""Literal search over a package: Chinese, paths, identifiers, matches split across parts, the tail
of a very long line, the 8 MiB page budget continued by cursor, bounded output."""

from __future__ import annotations

import json
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import package_testing
import pytest
from package_testing import TEXT_PART_BYTES, Item, PackageBuilder, evidence

from continuum_handoff_read import search as search_module
from continuum_handoff_read.deadline import Deadline
from continuum_handoff_read.results import OUTPUT_BYTES, ToolResult
from continuum_handoff_read.scanners import Scanners
from continuum_handoff_read.tool import execute
from continuum_merge.extraction.aggregate import verify_handoff
from continuum_merge.snapshot.verify import verify_snapshot
from continuum_runtime.clock import SystemClock

KEY = b"handoff-read-test-cursor-key-32b"
# The scanner processes `call` lends its searches, set per test by `scan_mode` (None: in the call's thread).
SCANNERS: Scanners | None = None


@pytest.fixture(autouse=True, params=["in the call's thread", "with scanner processes"])
def scan_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, scanner_processes: Scanners) -> None:
    """Every test here (and in modules importing this fixture) runs once with searches scanning in the
    call's thread and once with scanner processes: the answers must be the same."""
    lent = scanner_processes if request.param == "with scanner processes" else None
    monkeypatch.setattr(sys.modules[__name__], "SCANNERS", lent)


def call(package: Path, version: str, **arguments: Any) -> ToolResult:
    """One HandoffRead call with a fresh 15 s deadline; its wrapped text is within the budget."""
    result = execute(
        package,
        version,
        json.dumps(arguments),
        cursor_key=KEY,
        deadline=Deadline(SystemClock()),
        scanners=SCANNERS,
    )
    assert len(result.wrapped().encode()) <= OUTPUT_BYTES
    return result


def every_page(package: Path, version: str, **arguments: Any) -> list[ToolResult]:
    """All pages of a call, following next_cursor until complete."""
    pages = [call(package, version, **arguments)]
    while not pages[-1].complete:
        assert pages[-1].next_cursor
        pages.append(call(package, version, **arguments, cursor=pages[-1].next_cursor))
        assert len(pages) < 1000
    return pages


@pytest.fixture
def small(tmp_path: Path) -> tuple[Path, str, dict[str, str]]:
    package = tmp_path / "op-small"
    builder = PackageBuilder(package)
    builder.session("a", "a", "frontend")
    refs = {
        "chinese": builder.message("a", 1, "用户要求 把响应字段 name 改为 displayName 并保留旧字段一周"),
        "path": builder.message("a", 2, "edited services/api/handlers/user_profile.py and ran pytest -k profile"),
    }
    builder.session("b", "b", "backend")
    refs["identifier"] = builder.message("b", 3, "def resolve_display_name(user):\n    return user.displayName\n")
    builder.unit(
        "u1",
        [
            Item("conflicts_todos", "pending", "前端仍读取 name 联调待办", [evidence(refs["chinese"], "a")]),
            Item(
                "changes", "completed", "renamed name to displayName in user_profile.py", [evidence(refs["path"], "a")]
            ),
        ],
    )
    return package, builder.finish(), refs


def test_the_test_packages_are_what_merge_itself_verifies(small: tuple[Path, str, dict[str, str]]) -> None:
    package, version, _ = small
    assert verify_snapshot(package).record_count == 5
    assert verify_handoff(package).handoff_hash == version


def test_chinese_paths_and_identifiers_are_found_with_their_refs(small: tuple[Path, str, dict[str, str]]) -> None:
    package, version, refs = small
    chinese = call(package, version, action="search", query="displayName 并保留")
    assert chinese.complete
    assert [entry.ref for entry in chinese.entries] == [f"r_{refs['chinese']}:p0"]
    assert "把响应字段 name 改为 displayName 并保留旧字段一周" in chinese.entries[0].text

    path = call(package, version, action="search", query="services/api/handlers/user_profile.py")
    assert [entry.ref for entry in path.entries] == [f"r_{refs['path']}:p0"]
    assert "at byte 7:" in path.entries[0].text

    identifier = call(package, version, action="search", query="resolve_display_name")
    assert [(entry.ref, entry.kind) for entry in identifier.entries] == [(f"r_{refs['identifier']}:p0", "part")]

    # The handoff's items are searched too, after the records.
    todo = call(package, version, action="search", query="联调待办")
    assert [entry.kind for entry in todo.entries] == ["item"]
    assert todo.entries[0].text.startswith("[conflicts_todos / pending]")


def test_source_and_section_narrow_the_search(small: tuple[Path, str, dict[str, str]]) -> None:
    package, version, refs = small
    everywhere = call(package, version, action="search", query="displayName")
    assert len(everywhere.entries) == 3  # two records, one item
    in_b = call(package, version, action="search", query="displayName", source_id="b")
    assert [entry.ref for entry in in_b.entries] == [f"r_{refs['identifier']}:p0"]
    in_changes = call(package, version, action="search", query="displayName", section="changes")
    assert [entry.kind for entry in in_changes.entries] == ["item"]
    assert call(package, version, action="search", query="displayName", section="artifacts").entries == ()
    nothing = call(package, version, action="search", query="not anywhere")
    assert nothing.complete
    assert nothing.entries == ()
    assert "No match" in nothing.warning


def test_a_match_split_across_two_parts_is_found_once(tmp_path: Path) -> None:
    package = tmp_path / "op-split"
    builder = PackageBuilder(package)
    builder.session("a", "a")
    needle = "跨片的标识符 split_identifier_名字"
    encoded = needle.encode()
    # The needle starts 10 bytes before the 32 KiB cut, so part 0 holds its head and part 1 its tail.
    head = b"x" * (TEXT_PART_BYTES - 10)
    ref = builder.message("a", 1, head + encoded + b" and the rest")
    version = builder.finish()
    parts = sorted((package / "snapshot" / "text").glob(f"{ref}-*.txt"))
    assert len(parts) == 2
    assert encoded not in parts[0].read_bytes()
    assert encoded not in parts[1].read_bytes()

    found = call(package, version, action="search", query=needle)

    assert found.complete
    assert [entry.ref for entry in found.entries] == [f"r_{ref}:p0"]
    assert f"at byte {len(head)}:" in found.entries[0].text
    assert needle in found.entries[0].text


def test_the_tail_of_a_very_long_line_is_searched(tmp_path: Path) -> None:
    package = tmp_path / "op-long-line"
    builder = PackageBuilder(package)
    builder.session("a", "a")
    line = "a" * 3_000_000 + " the end of the line: TAIL_MARKER_42 路径/尾部"
    ref = builder.message("a", 1, line)
    version = builder.finish()

    found = call(package, version, action="search", query="TAIL_MARKER_42 路径/尾部")

    assert found.complete
    last_part = (3_000_000 + 30) // TEXT_PART_BYTES
    assert [entry.ref for entry in found.entries] == [f"r_{ref}:p{last_part}"]


def big_package(tmp_path: Path, megabytes: int, needle: bytes, every: int) -> tuple[Path, str, int]:
    """A package of `megabytes` MiB of text in 512 KiB records, `needle` planted in every `every`-th
    record (one of them across a part cut); how many times it was planted."""
    package = tmp_path / "op-big"
    builder = PackageBuilder(package)
    builder.session("a", "a")
    record = 512 * 1024
    planted = 0
    for index in range(megabytes * 2):
        body = bytearray(b"lorem ipsum dolor sit amet " * (record // 27))
        if index % every == 0:
            cut = TEXT_PART_BYTES * 3 - len(needle) // 2 if planted % 2 else 1000 + index
            body[cut : cut + len(needle)] = needle
            planted += 1
        builder.message("a", index + 1, bytes(body))
    return package, builder.finish(), planted


def test_a_scan_stops_at_8_mib_and_continues_by_cursor_to_the_end(tmp_path: Path) -> None:
    needle = "needle/在这里".encode()
    package, version, planted = big_package(tmp_path, 30, needle, 7)

    pages = every_page(package, version, action="search", query=needle.decode())

    assert len(pages) >= 4  # 30 MiB of text in pages of at most 8 MiB
    for page in pages[:-1]:
        assert not page.complete
        assert "what this page did not show may still be in the package" in page.warning
    assert pages[-1].complete
    found = [(entry.ref, entry.text) for page in pages for entry in page.entries]
    assert len(found) == planted
    assert len(set(found)) == planted  # nothing reported twice


def test_output_stays_bounded_and_every_match_is_reached_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "op-many"
    builder = PackageBuilder(package)
    builder.session("a", "a")
    # 3000 matches in one record of 6 parts: far more than one page shows.
    body = "".join(f"line {number}: token_hit here\n" for number in range(3000))
    builder.message("a", 1, body * 1)
    version = builder.finish()
    monkeypatch.setattr(search_module, "CONTEXT_BYTES", 300)

    pages = every_page(package, version, action="search", query="token_hit", limit=100)

    assert len(pages) > 5
    assert all(len(page.wrapped().encode()) <= OUTPUT_BYTES for page in pages)
    texts = [entry.text for page in pages for entry in page.entries]
    assert len(texts) == 3000
    assert len(set(texts)) == 3000


def test_the_source_filter_walks_records_beside_files_across_pages(tmp_path: Path) -> None:
    needle = b"SOURCE_ONLY_NEEDLE"
    package = tmp_path / "op-sources"
    builder = PackageBuilder(package)
    for source in ("a", "b"):
        builder.session(source, source)
        builder.session(f"{source}-child", source)
        for index in range(12):
            body = bytearray(b"z" * (1024 * 1024))
            body[5000 : 5000 + len(needle)] = needle
            builder.message(f"{source}-child" if index % 2 else source, index + 1, bytes(body))
    version = builder.finish()

    pages = every_page(package, version, action="search", query=needle.decode(), source_id="b")

    assert len(pages) >= 2
    refs = {entry.ref for page in pages for entry in page.entries}
    assert len(refs) == 12
    everywhere = every_page(package, version, action="search", query=needle.decode())
    assert len({entry.ref for page in everywhere for entry in page.entries}) == 24


def test_a_match_is_never_made_of_two_records(tmp_path: Path) -> None:
    package = tmp_path / "op-two-records"
    builder = PackageBuilder(package)
    builder.session("a", "a")
    builder.message("a", 1, "the end of one record: JOINED_")
    builder.message("a", 2, "ACROSS_RECORDS is how the next one begins")
    whole = builder.message("a", 3, "but here JOINED_ACROSS_RECORDS is whole")
    version = builder.finish()

    found = call(package, version, action="search", query="JOINED_ACROSS_RECORDS")

    assert [entry.ref for entry in found.entries] == [f"r_{whole}:p0"]


def test_memory_stays_bounded_whatever_the_package_size(tmp_path: Path) -> None:
    needle = b"MEMORY_NEEDLE"
    package, version, _ = big_package(tmp_path, 24, needle, 5)
    tracemalloc.start()
    try:
        pages = every_page(package, version, action="search", query=needle.decode())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(pages) >= 3
    # One 1 MiB read buffer, one manifest buffer and one page: not the 24 MiB of text, not the manifests.
    assert peak < 6 * 1024 * 1024, peak


def test_pages_that_stop_inside_parts_and_buffers_find_every_match_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Odd page budgets and tiny buffers make pages stop inside parts and scans carry bytes between
    buffers of one part: the matches found are exactly those of each record's whole text."""
    needle = "needle/在这里"
    package = tmp_path / "op-odd"
    builder = PackageBuilder(package)
    builder.session("a", "a")
    texts = {}
    for index in range(6):
        chunks = []
        for position in range(40):
            chunks.append("汉字 filler text " * (7 + (position * 13 + index) % 50))
            chunks.append(needle)
        text = "".join(chunks)
        texts[builder.message("a", index + 1, text)] = text.encode()
    version = builder.finish()
    expected = set()
    for ref, data in texts.items():
        # Parts end on code point boundaries: a match belongs to the part holding its first byte.
        starts = [0]
        for piece in package_testing.utf8_parts(data):
            starts.append(starts[-1] + len(piece))
        found = data.find(needle.encode())
        while found >= 0:
            part = max(number for number, start in enumerate(starts[:-1]) if start <= found)
            expected.add((f"r_{ref}:p{part}", found - starts[part]))
            found = data.find(needle.encode(), found + 1)
    assert len(expected) == 240
    monkeypatch.setattr(search_module, "SCAN_BYTES", 10_007)
    monkeypatch.setattr(search_module, "BUFFER_BYTES", 997)

    pages = every_page(package, version, action="search", query=needle, limit=7)

    reported = [(entry.ref, int(entry.text.split("at byte ")[1].split(":")[0])) for p in pages for entry in p.entries]
    assert len(reported) == len(set(reported))
    assert set(reported) == expected
    assert len(pages) > 20


def test_a_page_stopping_just_after_a_part_cut_still_finds_the_match_across_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "op-cut"
    builder = PackageBuilder(package)
    builder.session("a", "a")
    needle = b"ACROSS_THE_CUT_42"
    head = b"x" * (TEXT_PART_BYTES - 7)
    ref = builder.message("a", 1, head + needle + b"y" * 100)
    version = builder.finish()
    # The session record's part, part 0, and 5 bytes of part 1: the page ends inside the needle.
    session_part = (package / "snapshot" / "text").glob("*.txt")
    session_bytes = sum(path.stat().st_size for path in session_part if not path.name.startswith(ref))
    monkeypatch.setattr(search_module, "SCAN_BYTES", session_bytes + TEXT_PART_BYTES + 5)

    pages = every_page(package, version, action="search", query=needle.decode())

    assert not pages[0].entries
    assert not pages[0].complete
    found = [entry for page in pages for entry in page.entries]
    assert [(entry.ref, entry.text.split(":")[0]) for entry in found] == [(f"r_{ref}:p0", f"at byte {len(head)}")]
