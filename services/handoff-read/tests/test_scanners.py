"""Scanner processes: a search answers the same whether its pieces are small or large, whether a scanner
died, and whether every scanner is busy elsewhere."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest
from package_testing import TEXT_PART_BYTES, PackageBuilder

from continuum_handoff_read import search as search_module
from continuum_handoff_read.deadline import Deadline
from continuum_handoff_read.errors import BudgetExceeded
from continuum_handoff_read.files import PackageFiles
from continuum_handoff_read.results import ToolResult
from continuum_handoff_read.scanners import Lent, Piece, Prescan, Scanners, _wire_bytes, prescan
from continuum_handoff_read.tool import execute
from continuum_runtime.clock import SystemClock

KEY = b"handoff-read-test-cursor-key-32b"
NEEDLE = "跨片_NEEDLE/path::name"
# Planted in other records: a search for it pages like one for NEEDLE, and finds other parts.
OTHER = "OTHER_NEEDLE_42"


def every_match(package: Path, version: str, scanners: Scanners | None, **arguments: Any) -> list[tuple[str, str]]:
    """Every match of a search (for NEEDLE unless `query` is given), page by page, as (ref, excerpt)."""
    found: list[tuple[str, str]] = []
    cursor = ""
    for _ in range(1000):
        given = {"action": "search", "query": NEEDLE} | arguments | ({"cursor": cursor} if cursor else {})
        result: ToolResult = execute(
            package, version, json.dumps(given), cursor_key=KEY, deadline=Deadline(SystemClock()), scanners=scanners
        )
        found += [(entry.ref, entry.text) for entry in result.entries]
        if result.complete:
            return found
        cursor = result.next_cursor
    raise AssertionError("the search never completed")


@pytest.fixture
def package(tmp_path: Path) -> tuple[Path, str, int]:
    """Records of one to four parts with the needle planted inside parts and across every kind of cut."""
    return build_package(tmp_path / "op-pieces")


def build_package(directory: Path, seed: int = 0) -> tuple[Path, str, int]:
    """The package of the `package` fixture in `directory` (another `seed`: other record sizes)."""
    builder = PackageBuilder(directory)
    builder.session("a", "a")
    needle = NEEDLE.encode()
    planted = 0
    for index in range(60):
        body = bytearray(b"filler words and more filler " * ((1 + (index + seed) % 4) * TEXT_PART_BYTES // 29))
        if index % 3 == 0:
            cut = TEXT_PART_BYTES * (1 + index % 2) - len(needle) // 2  # across a cut
            body[cut : cut + len(needle)] = needle
            planted += 1
        if index % 5 == 0:
            body[100 : 100 + len(needle)] = needle
            planted += 1
        if index % 7 == 3:
            body[200 : 200 + len(OTHER)] = OTHER.encode()
        builder.message("a", index + 1, bytes(body))
    return builder.package_dir, builder.finish(), planted


@pytest.fixture
def own_scanners() -> Iterator[tuple[Scanners, list[BaseProcess]]]:
    """Two scanner processes of this test alone, and their processes."""
    before = set(multiprocessing.active_children())
    scanners = Scanners(2)
    try:
        yield scanners, [child for child in multiprocessing.active_children() if child not in before]
    finally:
        scanners.close()


def test_pieces_of_a_row_or_two_find_exactly_what_the_calls_thread_finds(
    package: tuple[Path, str, int], scanner_processes: Scanners, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, version, planted = package
    alone = every_match(root, version, None)
    assert len(alone) == planted
    # Every piece boundary falls between two rows, many between two parts of one record.
    monkeypatch.setattr(search_module, "PIECE_MIN_BYTES", 300)
    monkeypatch.setattr(search_module, "PIECE_MAX_BYTES", 700)
    assert every_match(root, version, scanner_processes) == alone
    # Pages that stop mid-round and pages full after one match: the same matches (an excerpt may end
    # sooner where a page's budget ended inside its part).
    monkeypatch.setattr(search_module, "SCAN_BYTES", 3 * TEXT_PART_BYTES + 17)
    assert where(every_match(root, version, scanner_processes, limit=1)) == where(alone)


def where(found: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The refs and offsets of matches, without their excerpts."""
    return [(ref, text.split(":")[0]) for ref, text in found]


def test_a_killed_scanner_is_replaced_and_the_search_answers_the_same(
    package: tuple[Path, str, int], own_scanners: tuple[Scanners, list[BaseProcess]]
) -> None:
    root, version, _ = package
    scanners, processes = own_scanners
    alone = every_match(root, version, None)
    assert len(processes) == 2
    for process in processes:
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
        process.join(10)

    assert every_match(root, version, scanners) == alone
    assert every_match(root, version, scanners) == alone
    with scanners.borrow(None, -1, -1) as lent:
        assert len(lent.scanners) == 2
        assert all(scanner.process.is_alive() for scanner in lent.scanners)


def test_a_search_finding_every_scanner_lent_scans_in_its_own_thread(
    package: tuple[Path, str, int], own_scanners: tuple[Scanners, list[BaseProcess]]
) -> None:
    root, version, _ = package
    scanners, _ = own_scanners
    alone = every_match(root, version, None)
    with scanners.borrow(None, -1, -1) as lent:
        assert len(lent.scanners) == 2
        sent = [scanner.sent for scanner in lent.scanners]
        assert every_match(root, version, scanners) == alone
        # Nothing went to the lent scanners: the search scanned in its own thread.
        assert [scanner.sent for scanner in lent.scanners] == sent


def page(package: Path, version: str, scanners: Scanners | None, query: str, cursor: str = "") -> ToolResult:
    """One page of a search."""
    given = {"action": "search", "query": query} | ({"cursor": cursor} if cursor else {})
    return execute(
        package, version, json.dumps(given), cursor_key=KEY, deadline=Deadline(SystemClock()), scanners=scanners
    )


def test_pages_read_ahead_are_picked_up_only_by_the_next_page_of_the_same_search(
    package: tuple[Path, str, int], own_scanners: tuple[Scanners, list[BaseProcess]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page ending at its budget sends the next page's first pieces: two searches paging in turns (their
    pages end at the same rows, so each page of one starts where the other parked), and every page asked
    for twice (a retry), answer exactly what each search answers paging alone, which finds what the
    call's thread finds."""
    root, version, _ = package
    scanners, _ = own_scanners
    monkeypatch.setattr(search_module, "SCAN_BYTES", 5 * TEXT_PART_BYTES)
    picked_up: list[bool] = []
    borrow = Scanners.borrow

    @contextmanager
    def recording(self: Scanners, key: Hashable, row: int, previous: int) -> Iterator[Lent]:
        with borrow(self, key, row, previous) as lent:
            picked_up.append(lent.parked is not None)
            yield lent

    monkeypatch.setattr(Scanners, "borrow", recording)
    alone = {query: every_page(root, version, scanners, query) for query in (NEEDLE, OTHER)}
    assert min(len(pages) for pages in alone.values()) > 10
    # Paging alone, every page but each search's first picked up the read-ahead of the page before.
    assert picked_up == [False, *[True] * (len(alone[NEEDLE]) - 1), False, *[True] * (len(alone[OTHER]) - 1)]
    picked_up.clear()
    for query, pages in alone.items():
        found = [(entry.ref, entry.text) for p in pages for entry in p.entries]
        assert found
        assert where(found) == where(every_match(root, version, None, query=query))

    # OTHER one page ahead: each of its pages starts where NEEDLE's page before it parked its read-ahead.
    turns: dict[str, list[ToolResult]] = {NEEDLE: [], OTHER: [page(root, version, scanners, OTHER)]}
    while not all(pages and pages[-1].complete for pages in turns.values()):
        for query, pages in turns.items():
            if pages and pages[-1].complete:
                continue
            cursor = pages[-1].next_cursor if pages else ""
            first = page(root, version, scanners, query, cursor)
            again = page(root, version, scanners, query, cursor)  # a retry of the same page
            assert (again.entries, again.next_cursor) == (first.entries, first.next_cursor)
            pages.append(again)
    for query in (NEEDLE, OTHER):
        assert [(p.entries, p.next_cursor) for p in turns[query]] == [(p.entries, p.next_cursor) for p in alone[query]]
    # In turns, no page picked up a read-ahead: the other search's page always came in between.
    assert not any(picked_up)


def every_page(package: Path, version: str, scanners: Scanners, query: str) -> list[ToolResult]:
    """Every page of one search, one after another."""
    pages = [page(package, version, scanners, query)]
    while not pages[-1].complete:
        pages.append(page(package, version, scanners, query, pages[-1].next_cursor))
    return pages


def test_a_parked_read_ahead_is_never_picked_up_after_another_page_used_its_scanners(
    package: tuple[Path, str, int],
    own_scanners: tuple[Scanners, list[BaseProcess]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """The race a lock prevents, forced: a page of another search runs on the scanners after a page parked
    and before the park is looked at (as if it had borrowed them just before the park). The next page of
    the first search must not take the other page's answers for its own."""
    root, version, _ = package
    scanners, _ = own_scanners
    monkeypatch.setattr(search_module, "SCAN_BYTES", 5 * TEXT_PART_BYTES)
    alone = every_page(root, version, scanners, NEEDLE)
    other_root, other_version, _ = build_package(tmp_path / "op-other", seed=1)
    first = page(root, version, scanners, NEEDLE)
    parked = scanners._parked
    assert parked is not None
    scanners._parked = None
    # A page of another package ending at its budget: as many pieces out as the parked page had.
    assert not page(other_root, other_version, scanners, NEEDLE).complete
    scanners._parked = parked
    with scanners.borrow(parked.key, parked.row, parked.previous) as lent:
        assert lent.parked is None  # its scanners were sent another page's pieces since
    scanners._parked = parked
    second = page(root, version, scanners, NEEDLE, first.next_cursor)
    assert (second.entries, second.next_cursor) == (alone[1].entries, alone[1].next_cursor)


def test_scanners_stuck_past_the_deadline_end_the_page_in_time_and_are_replaced(
    package: tuple[Path, str, int], own_scanners: tuple[Scanners, list[BaseProcess]], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, version, _ = package
    scanners, processes = own_scanners
    alone = every_match(root, version, None)
    for process in processes:
        assert process.pid is not None
        os.kill(process.pid, signal.SIGSTOP)
    try:
        given = json.dumps({"action": "search", "query": NEEDLE})
        started = time.monotonic()
        with pytest.raises(BudgetExceeded):
            execute(root, version, given, cursor_key=KEY, deadline=Deadline(SystemClock(), 1.0), scanners=scanners)
        assert time.monotonic() - started < 10
    finally:
        for process in processes:
            if process.pid is not None and process.is_alive():
                os.kill(process.pid, signal.SIGCONT)
    # The stuck ones were replaced: the next searches use new scanners and answer as the thread does.
    assert every_match(root, version, scanners) == alone
    with scanners.borrow(None, -1, -1) as lent:
        assert len(lent.scanners) == 2
        assert not {scanner.process.pid for scanner in lent.scanners} & {process.pid for process in processes}


def test_a_pieces_first_row_continuing_a_part_it_cannot_see_is_left_to_the_reader(tmp_path: Path) -> None:
    """A piece whose first row is part 1 of a record: with the line naming part 0 before it, the scanner
    carries part 0's tail and flags nothing without a match; without it, it flags the row for the reader
    (which knows the part before)."""
    builder = PackageBuilder(tmp_path / "op-first-row")
    builder.session("a", "a")
    ref = builder.message("a", 1, b"x" * (3 * TEXT_PART_BYTES))
    builder.finish()
    files = PackageFiles(tmp_path / "op-first-row")
    try:
        stream = (tmp_path / "op-first-row" / "snapshot" / "files.jsonl").read_bytes()
        lines = stream.split(b"\n")
        first, second = (
            index
            for index, line in enumerate(lines)
            if f"{ref}-0.txt".encode() in line or f"{ref}-1.txt".encode() in line
        )
        offset = sum(len(line) + 1 for line in lines[:second])
        rest = b"".join(line + b"\n" for line in lines[second:] if line)
        buffer = bytearray(1024 * 1024 + 64)

        def scanned(previous: bytes) -> Prescan:
            piece = Piece(
                str(tmp_path / "op-first-row"), files.identity(), offset, rest, previous, b"NOWHERE", 1024 * 1024
            )
            return prescan(piece, files, buffer)

        assert scanned(lines[first]).flagged == []
        assert scanned(b"").flagged == [0]
    finally:
        files.close()


def test_a_scanners_programming_error_is_logged_with_its_frames_and_never_its_message(
    package: tuple[Path, str, int], own_scanners: tuple[Scanners, list[BaseProcess]], caplog: pytest.LogCaptureFixture
) -> None:
    root, _, _ = package
    scanners, _ = own_scanners
    files = PackageFiles(root)
    try:
        lines = (root / "snapshot" / "files.jsonl").read_bytes()
        # A query of the wrong type fails inside the scanner with a TypeError naming it.
        broken = Piece(str(root), files.identity(), 0, lines, b"", "a str query", 1024 * 1024)  # type: ignore[arg-type]
        with scanners.borrow(None, -1, -1) as lent:
            scanner = lent.scanners[0]
            assert scanner.send(broken)
            assert scanner.receive(Deadline(SystemClock())) is None
            assert scanner.broken
    finally:
        files.close()
    [record] = [r for r in caplog.records if r.name == "continuum.handoff_read" and "scanner failed" in r.getMessage()]
    assert record.exception == "TypeError"  # type: ignore[attr-defined]
    assert any(frame["function"] == "prescan" for frame in record.frames)  # type: ignore[attr-defined]
    # The TypeError's message ("... bytes-like object, not 'str'") stays out of the log.
    assert "bytes-like" not in str(record.__dict__)


def test_two_of_the_largest_pieces_fit_in_a_scanners_pipe(own_scanners: tuple[Scanners, list[BaseProcess]]) -> None:
    """Short parts make the largest pieces: two of them (each after a long line) may still be out at once."""
    scanners, _ = own_scanners
    largest = Piece("/" + "d" * 255, (1, 1), 0, b"x" * search_module.PIECE_MAX_BYTES, b"y" * 1024, b"q" * 256, 1)
    with scanners.borrow(None, -1, -1) as lent:
        for scanner in lent.scanners:
            assert scanner.takes(largest)
            scanner._out_bytes.append(_wire_bytes(largest))  # as if one were out, without sending it
            try:
                assert scanner.takes(largest)
            finally:
                scanner._out_bytes.pop()
