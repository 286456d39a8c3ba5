"""The read-only tools stay beneath the working directory: no '..', no absolute path, no symlink out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from continuum_agent.tools import LIST_DIRECTORY, READ_FILE, SEARCH_TEXT, Workspace, run_tool


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Workspace, Path]:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    (root / "src").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.txt").write_text("SECRET displayName\n")
    (root / "src" / "a.py").write_text("name = 1\ndisplayName = 2\n")
    (root / "big.txt").write_text("x" * 5000)
    (root / "escape").symlink_to(outside)
    (root / "escape.txt").symlink_to(outside / "secret.txt")
    (root / "inside.txt").symlink_to(root / "src" / "a.py")
    workspace = Workspace.of(str(root), max_result_bytes=1024)
    assert workspace is not None
    return workspace, outside


def call(workspace: Workspace | None, name: str, **arguments: Any) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(run_tool(workspace, name, json.dumps(arguments)))
    return result


def test_list_read_and_search_beneath_the_root(layout: tuple[Workspace, Path]) -> None:
    workspace, _ = layout

    listing = call(workspace, LIST_DIRECTORY, path=".")
    read = call(workspace, READ_FILE, path="src/a.py")
    found = call(workspace, SEARCH_TEXT, query="displayName")

    assert [(e["name"], e["type"]) for e in listing["entries"]] == [
        ("big.txt", "file"),
        ("escape", "symlink"),
        ("escape.txt", "symlink"),
        ("inside.txt", "symlink"),
        ("src", "directory"),
    ]
    assert read == {"path": "src/a.py", "text": "name = 1\ndisplayName = 2\n", "truncated": False}
    # The symlink to a file inside is searched; the ones leading outside are not.
    assert [(m["path"], m["line"]) for m in found["matches"]] == [("inside.txt", 2), ("src/a.py", 2)]


@pytest.mark.parametrize(
    ("name", "arguments"),
    [
        (READ_FILE, {"path": "../outside/secret.txt"}),
        (READ_FILE, {"path": "src/../../outside/secret.txt"}),
        (READ_FILE, {"path": "/etc/passwd"}),
        (READ_FILE, {"path": "escape.txt"}),
        (READ_FILE, {"path": "escape/secret.txt"}),
        (LIST_DIRECTORY, {"path": "escape"}),
        (SEARCH_TEXT, {"query": "SECRET", "path": "escape"}),
        (SEARCH_TEXT, {"query": "SECRET", "path": ".."}),
    ],
)
def test_nothing_outside_the_root_is_reached(
    layout: tuple[Workspace, Path], name: str, arguments: dict[str, Any]
) -> None:
    workspace, _ = layout

    result = call(workspace, name, **arguments)

    assert set(result) == {"error"}
    assert "SECRET" not in json.dumps(result)


def test_a_long_file_is_cut_and_says_so(layout: tuple[Workspace, Path]) -> None:
    workspace, _ = layout

    result = call(workspace, READ_FILE, path="big.txt")

    assert result["truncated"] is True and len(result["text"]) == 1024


def test_long_matches_and_names_stop_at_the_byte_cap_and_say_so(tmp_path: Path) -> None:
    """Counts alone let 100 long non-ASCII lines (or long names) pass the cap: the bytes decide too."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "wide.txt").write_text("".join(f"界面 displayName {'界' * 280} {n}\n" for n in range(100)))
    for n in range(60):
        (root / f"{'名' * 60}-{n:02d}.txt").write_text("x")
    workspace = Workspace.of(str(root), max_result_bytes=8 * 1024)
    assert workspace is not None

    searched = call(workspace, SEARCH_TEXT, query="displayName")
    listed = call(workspace, LIST_DIRECTORY)

    for result, items in ((searched, "matches"), (listed, "entries")):
        assert result["truncated"] is True and result[items]
        assert len(json.dumps(result[items], ensure_ascii=False).encode()) <= 8 * 1024
    assert [match["line"] for match in searched["matches"]] == list(range(1, len(searched["matches"]) + 1))


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("no_such_tool", "{}"),
        (READ_FILE, "not json"),
        (READ_FILE, "[1]"),
        (READ_FILE, '{"path": 3}'),
        (READ_FILE, '{"path": "missing.txt"}'),
        (READ_FILE, '{"path": "src"}'),
        (SEARCH_TEXT, '{"query": ""}'),
        (LIST_DIRECTORY, '{"path": "big.txt"}'),
    ],
)
def test_bad_calls_are_refusals_the_model_can_read(layout: tuple[Workspace, Path], name: str, raw: str) -> None:
    workspace, _ = layout

    assert set(json.loads(run_tool(workspace, name, raw))) == {"error"}


def test_a_session_without_a_usable_directory_has_no_workspace(tmp_path: Path) -> None:
    assert Workspace.of("", 1024) is None
    assert Workspace.of("relative/dir", 1024) is None
    assert Workspace.of(str(tmp_path / "missing"), 1024) is None
    assert call(None, LIST_DIRECTORY) == {"error": "the session has no working directory"}
