"""What the package reader refuses: forged and reused cursors, another package's cursor or ref, path
traversal, planted symlinks, FIFOs and altered bytes, bad arguments, and a spent deadline."""

from __future__ import annotations

import base64
import json
import threading
from pathlib import Path

import grpc
import pytest
from package_testing import TEXT_PART_BYTES, PackageBuilder, replace_file
from test_search import KEY, call, scan_mode  # noqa: F401 (scan_mode: every test in both scan modes)

from continuum_handoff_read import errors, files
from continuum_handoff_read.deadline import Deadline
from continuum_handoff_read.tool import execute
from continuum_runtime.clock import SystemClock


@pytest.fixture
def package(tmp_path: Path) -> tuple[Path, str, str]:
    root = tmp_path / "op-one"
    builder = PackageBuilder(root)
    builder.session("a", "a")
    for index in range(40):
        builder.message("a", index + 1, f"record {index}: the shared_word appears here\n" * 2000)
    ref = builder.message("a", 99, "the only FINDME record")
    return root, builder.finish(), ref


def test_a_forged_cursor_is_refused(package: tuple[Path, str, str]) -> None:
    root, version, _ = package
    first = call(root, version, action="search", query="shared_word")
    assert not first.complete
    payload, mac = first.next_cursor.split(".")
    position = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    position["row"] = 0  # rewind to the start: the MAC no longer matches
    forged = base64.urlsafe_b64encode(json.dumps(position).encode()).decode().rstrip("=") + "." + mac
    for cursor in (forged, first.next_cursor[:-2] + "AA", "not-a-cursor", "x" * 1000):
        with pytest.raises(errors.CursorInvalid) as refused:
            call(root, version, action="search", query="shared_word", cursor=cursor)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.violations[0].field == "cursor"


def test_a_cursor_is_refused_with_another_query_filter_action_or_package(
    package: tuple[Path, str, str], tmp_path: Path
) -> None:
    root, version, _ = package
    cursor = call(root, version, action="search", query="shared_word").next_cursor
    assert call(root, version, action="search", query="shared_word", cursor=cursor).entries
    for changed in (
        {"action": "search", "query": "shared_wor"},
        {"action": "search", "query": "shared_word", "source_id": "a"},
        {"action": "search", "query": "shared_word", "limit": 5},
        {"action": "list"},
    ):
        with pytest.raises(errors.CursorInvalid):
            call(root, version, **changed, cursor=cursor)
    # Another package (another version) never opens it, even where the same files exist.
    other = tmp_path / "op-other"
    builder = PackageBuilder(other)
    builder.session("a", "a")
    builder.message("a", 1, "record 0: the shared_word appears here\n" * 2000)
    with pytest.raises(errors.CursorInvalid):
        call(other, builder.finish(), action="search", query="shared_word", cursor=cursor)


def test_a_ref_of_another_package_is_not_found_here(package: tuple[Path, str, str], tmp_path: Path) -> None:
    root, version, _ = package
    other = tmp_path / "op-other"
    builder = PackageBuilder(other)
    builder.session("z", "z")
    foreign = builder.message("z", 1, "foreign text")
    builder.finish()
    for ref in (f"r_{foreign}", f"r_{foreign}:p0", f"r_{foreign}:raw", "it_" + "0" * 32):
        with pytest.raises(errors.RefNotFound) as missing:
            call(root, version, action="read", ref=ref)
        assert missing.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(errors.RefNotFound):
        call(root, version, action="asset", ref="a_" + "0" * 64)


@pytest.mark.parametrize(
    "ref", ["../op-other/snapshot/raw/x.json", "/etc/passwd", "r_../../etc/passwd", "snapshot/records.jsonl", "r_AB"]
)
def test_paths_and_malformed_refs_are_refused_before_any_file_is_opened(
    package: tuple[Path, str, str], ref: str
) -> None:
    root, version, _ = package
    with pytest.raises(errors.BadRequest) as refused:
        call(root, version, action="read", ref=ref)
    assert refused.value.violations[0].field == "ref"


@pytest.mark.parametrize("how", ["symlink", "fifo", "tampered"])
def test_a_planted_symlink_fifo_or_altered_part_is_refused_as_damage(package: tuple[Path, str, str], how: str) -> None:
    root, version, ref = package
    replace_file(root / "snapshot" / "text" / f"{ref}-0.txt", how)
    done = threading.Event()
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call(root, version, action="read", ref=f"r_{ref}")
            outcome.append(None)
        except BaseException as error:
            outcome.append(error)
        done.set()

    # A FIFO opened without O_NONBLOCK would block this thread forever.
    threading.Thread(target=run, daemon=True).start()
    assert done.wait(10), "the read hung on a planted file"
    assert isinstance(outcome[0], errors.PackageDamaged), outcome
    # A symlink or FIFO is refused by any search that reaches it; altered bytes of the registered size
    # once a match would show them (the planted bytes are all "y").
    with pytest.raises(errors.PackageDamaged):
        call(root, version, action="search", query="yyyy" if how == "tampered" else "FINDME")


def test_an_altered_part_is_refused_before_any_excerpt_of_it_leaves(tmp_path: Path) -> None:
    """Search hashes a part only when something from it is handed out: an altered part with a match
    fails the whole call (no page, so no excerpt of it or of the parts before it on the page); one
    without a match, of its registered size, is scanned like any other."""
    root = tmp_path / "op-altered"
    builder = PackageBuilder(root)
    builder.session("a", "a")
    before = builder.message("a", 1, "an intact ALTERED_NEEDLE before the altered part")
    altered = builder.message("a", 2, "the ALTERED_NEEDLE in the part that will change")
    after = builder.message("a", 3, "an intact ALTERED_NEEDLE after it")
    version = builder.finish()
    part = root / "snapshot" / "text" / f"{altered}-0.txt"
    part.write_bytes(part.read_bytes().replace(b"the ", b"THE "))

    with pytest.raises(errors.PackageDamaged):
        call(root, version, action="search", query="ALTERED_NEEDLE")
    with pytest.raises(errors.PackageDamaged):
        call(root, version, action="search", query="ALTERED_NEEDLE", limit=2)  # the page fills with it
    with pytest.raises(errors.PackageDamaged):
        call(root, version, action="search", query="ALTERED_NEEDLE", source_id="a")
    # A query without a match in the altered part: its bytes never leave, so the search answers.
    intact = call(root, version, action="search", query="an intact ALTERED_NEEDLE")
    assert intact.complete
    assert [entry.ref for entry in intact.entries] == [f"r_{before}:p0", f"r_{after}:p0"]
    nothing = call(root, version, action="search", query="NOT_IN_THE_PACKAGE")
    assert (nothing.complete, nothing.entries) == (True, ())
    with pytest.raises(errors.PackageDamaged):
        call(root, version, action="search", query="THE ALTERED")  # only the altered bytes hold it


def test_a_match_across_a_cut_is_refused_when_the_part_before_the_cut_was_altered(tmp_path: Path) -> None:
    root = tmp_path / "op-cut-altered"
    builder = PackageBuilder(root)
    builder.session("a", "a")
    needle = b"ACROSS_AN_ALTERED_CUT"
    ref = builder.message("a", 1, b"x" * (TEXT_PART_BYTES - 7) + needle + b"y" * 100)
    version = builder.finish()
    assert call(root, version, action="search", query=needle.decode()).entries
    head = root / "snapshot" / "text" / f"{ref}-0.txt"
    head.write_bytes(b"z" + head.read_bytes()[1:])  # the same size; the match's head bytes unchanged

    with pytest.raises(errors.PackageDamaged):
        call(root, version, action="search", query=needle.decode())


def test_a_symlinked_directory_inside_the_package_is_refused(package: tuple[Path, str, str], tmp_path: Path) -> None:
    root, version, ref = package
    text = root / "snapshot" / "text"
    moved = tmp_path / "text-elsewhere"
    text.rename(moved)
    text.symlink_to(moved)
    with pytest.raises(errors.PackageDamaged):
        call(root, version, action="read", ref=f"r_{ref}:p0")


def test_a_manifest_altered_after_the_handoff_is_refused(package: tuple[Path, str, str]) -> None:
    root, version, _ = package
    files = root / "snapshot" / "files.jsonl"
    files.write_bytes(files.read_bytes().replace(b'"kind":"text"', b'"kind":"TEXT"', 1))
    with pytest.raises(errors.PackageDamaged):
        call(root, version, action="search", query="FINDME")


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"action": "grep"}, "action"),
        ({"action": "list", "path": "/etc"}, "path"),
        ({"action": "search"}, "query"),
        ({"action": "search", "query": "q" * 4097}, "query"),
        ({"action": "list", "limit": 201}, "limit"),
        ({"action": "read"}, "ref"),
        ({"action": "read", "ref": "r_" + "0" * 64, "query": "x"}, "query"),
        ({"action": "list", "limit": 0}, "limit"),
        ({"action": "list", "limit": "5"}, "limit"),
        ({"action": "list", "section": "secrets"}, "section"),
        ({"action": "list", "source_id": "a/../b"}, "source_id"),
    ],
)
def test_bad_arguments_name_their_field(
    package: tuple[Path, str, str], arguments: dict[str, object], field: str
) -> None:
    root, version, _ = package
    with pytest.raises(errors.BadRequest) as refused:
        call(root, version, **arguments)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.violations[0].field == field


def test_arguments_that_are_not_a_json_object_are_refused(package: tuple[Path, str, str]) -> None:
    root, version, _ = package
    for text in ("[1]", "{", "x" * 9000):
        with pytest.raises(errors.BadRequest) as refused:
            execute(root, version, text, cursor_key=KEY, deadline=Deadline(StepClock(0)))
        assert refused.value.violations[0].field == "arguments_json"


class StepClock:
    """A clock whose monotonic time moves `step` seconds every time it is read."""

    def __init__(self, step: float) -> None:
        self.step = step
        self.now = 0.0

    def now_ms(self) -> int:
        return int(self.now * 1000)

    def monotonic(self) -> float:
        self.now += self.step
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_spent_deadline_is_budget_exceeded_and_a_late_one_ends_the_page_with_a_cursor(
    package: tuple[Path, str, str],
) -> None:
    root, version, ref = package
    with pytest.raises(errors.BudgetExceeded) as spent:
        execute(root, version, '{"action": "list"}', cursor_key=KEY, deadline=Deadline(StepClock(20)))
    assert spent.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    cancelled = Deadline(StepClock(0))
    cancelled.cancel()
    with pytest.raises(errors.BudgetExceeded):
        execute(root, version, '{"action": "list"}', cursor_key=KEY, deadline=cancelled)
    # Time runs out part way through the scan: the page ends with what it found and a cursor.
    late = execute(
        root, version, '{"action": "search", "query": "FINDME"}', cursor_key=KEY, deadline=Deadline(StepClock(0.5))
    )
    assert not late.complete
    assert "time budget" in late.warning
    assert late.next_cursor
    # Its cursor resumes at the part the clock stopped before: the match is found, once.
    found = list(late.entries)
    cursor = late.next_cursor
    while cursor:
        page = call(root, version, action="search", query="FINDME", cursor=cursor)
        found += page.entries
        cursor = "" if page.complete else page.next_cursor
    assert [entry.ref for entry in found] == [f"r_{ref}:p0"]


def test_without_openat2_the_walk_refuses_the_same_planted_directory(
    package: tuple[Path, str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, version, ref = package
    monkeypatch.setattr(files, "_SYSCALL", None)
    assert call(root, version, action="read", ref=f"r_{ref}:p0").entries[0].text == "the only FINDME record"
    text = root / "snapshot" / "text"
    moved = tmp_path / "text-elsewhere"
    text.rename(moved)
    text.symlink_to(moved)
    with pytest.raises(errors.PackageDamaged):
        call(root, version, action="read", ref=f"r_{ref}:p0")


class CountingIntact(files.IntactFiles):
    """IntactFiles that counts the files it was told were hashed and found intact."""

    def __init__(self) -> None:
        super().__init__()
        self.added = 0

    def add(self, identity: tuple[int | str, ...]) -> None:
        self.added += 1
        super().add(identity)


def test_intact_manifests_are_hashed_once_and_again_after_a_write(package: tuple[Path, str, str]) -> None:
    root, version, _ = package
    intact = CountingIntact()

    def search() -> None:
        arguments = '{"action": "search", "query": "FINDME"}'
        assert execute(
            root, version, arguments, cursor_key=KEY, deadline=Deadline(SystemClock()), intact=intact
        ).complete

    search()
    assert intact.added == 2  # files.jsonl and details.jsonl
    search()
    search()
    assert intact.added == 2
    # A manifest written since has another ctime: hashed again, and refused.
    manifest = root / "snapshot" / "files.jsonl"
    manifest.write_bytes(manifest.read_bytes().replace(b'"kind":"text"', b'"kind":"TEXT"', 1))
    with pytest.raises(errors.PackageDamaged):
        search()


def test_a_read_cursor_opens_only_for_the_ref_it_was_issued_for(package: tuple[Path, str, str]) -> None:
    root, version, _ = package
    listing = call(root, version, action="list", source_id="a", limit=3)
    first, second = (entry.ref for entry in listing.entries[1:3])
    page = call(root, version, action="read", ref=first)
    assert not page.complete  # 90 KB of text: several pages
    assert call(root, version, action="read", ref=first, cursor=page.next_cursor).entries
    with pytest.raises(errors.CursorInvalid):
        call(root, version, action="read", ref=second, cursor=page.next_cursor)
    with pytest.raises(errors.CursorInvalid):
        call(root, version, action="read", ref=f"{first}:raw", cursor=page.next_cursor)
