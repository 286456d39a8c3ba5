"""`continuum up` seeds the demo only into an empty data dir, or finishes a seed an earlier run began."""

from __future__ import annotations

from pathlib import Path

from continuum_cli import demo


def test_demo_seed_decision_only_for_an_empty_or_unfinished_data_dir(tmp_path: Path) -> None:
    empty = tmp_path / "new"
    assert demo.wanted(empty, demo.is_empty(empty))
    empty.mkdir()
    assert demo.is_empty(empty)
    (empty / "notes.txt").write_text("mine")
    assert not demo.wanted(empty, demo.is_empty(empty))
    (empty / demo.PENDING_MARKER).touch()
    assert demo.wanted(empty, demo.is_empty(empty)), "an interrupted seed is finished on the next run"
