"""list, read and asset over a package: directories from the manifests, records, parts, raw JSON and
items paged on UTF-8 boundaries within the output budget, attachments within the image budget."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from package_testing import Item, PackageBuilder, evidence
from test_search import call, every_page

from continuum_handoff_read import errors
from continuum_handoff_read.results import OUTPUT_BYTES

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4


@pytest.fixture
def package(tmp_path: Path) -> tuple[Path, str, dict[str, str]]:
    root = tmp_path / "op-read"
    builder = PackageBuilder(root)
    builder.session("a", "a", "frontend", last_message_id=3)
    builder.session("a-sub", "a", "a subtask")
    # 200 KB of mixed Chinese and ASCII: seven parts, and pages that must cut between code points.
    long_text = "".join(f'第{n}行 交接资料 line {n} "quoted" \\ tab\t\n' for n in range(4000))
    refs = {
        "long": builder.message("a", 1, long_text),
        "image": builder.message("a", 2, "see the screenshot", attachments=[("att-1", "image/png", PNG)]),
        "big": builder.message("a-sub", 3, "a big log", attachments=[("att-2", "image/png", b"\0" * 1_125_001)]),
        "text": builder.message(
            "a-sub", 4, "notes attached", attachments=[("att-3", "text/plain", ("笔记 " * 9000).encode())]
        ),
        "zip": builder.message("a-sub", 5, "an archive", attachments=[("att-4", "application/zip", b"PK\3\4")]),
    }
    builder.session("b", "b", "backend")
    refs["b"] = builder.message("b", 1, "backend notes")
    refs["items"] = json.dumps(
        builder.unit(
            "u1",
            [
                Item("goals_constraints", "recorded", "keep the old field for a week", [evidence(refs["long"], "a")]),
                Item(
                    "conflicts_todos",
                    "pending",
                    "联调待办 " * 3000,
                    [evidence(refs["b"], "b"), evidence(refs["long"], "a", 2)],
                ),
            ],
        )
    )
    refs["long_text"] = long_text
    return root, builder.finish(), refs


def test_list_without_filters_gives_sources_sections_and_attachments(package: tuple[Path, str, dict[str, str]]) -> None:
    root, version, _ = package
    pages = every_page(root, version, action="list", limit=5)
    entries = [entry for page in pages for entry in page.entries]
    assert [(entry.kind, entry.ref) for entry in entries if entry.kind == "source"] == [
        ("source", "a"),
        ("source", "b"),
    ]
    sections = {entry.ref: entry.text for entry in entries if entry.kind == "section"}
    assert len(sections) == 6
    assert "1 pending" in sections["conflicts_todos"]
    assert sections["artifacts"] == "section artifacts: nothing recorded"
    assets = [entry.text for entry in entries if entry.kind == "asset"]
    assert len(assets) == 4
    assert any("att-1 (image/png" in text for text in assets)
    assert len(pages) >= 3  # five entries a page


def test_list_with_a_source_gives_its_tree_and_with_a_section_its_items(
    package: tuple[Path, str, dict[str, str]],
) -> None:
    root, version, refs = package
    tree = call(root, version, action="list", source_id="a")
    assert tree.complete
    records = [entry.ref for entry in tree.entries if entry.kind == "record"]
    # Two session records and five messages of tree a (the subtask's included); none of b.
    assert len(records) == 7
    assert f"r_{refs['b']}" not in records
    assert [entry.kind for entry in tree.entries if entry.kind == "item"] == ["item", "item"]
    todos = call(root, version, action="list", section="conflicts_todos")
    assert [entry.ref for entry in todos.entries] == [json.loads(refs["items"])[1]]
    assert todos.entries[0].text.endswith("…")
    assert call(root, version, action="list", section="conflicts_todos", source_id="b").entries == todos.entries
    assert call(root, version, action="list", section="goals_constraints", source_id="b").entries == ()


def test_a_record_reads_whole_across_pages_cut_on_code_points(package: tuple[Path, str, dict[str, str]]) -> None:
    root, version, refs = package
    pages = every_page(root, version, action="read", ref=f"r_{refs['long']}")
    assert len(pages) > 10
    assert all(len(page.wrapped().encode()) <= OUTPUT_BYTES for page in pages)
    assert "".join(page.entries[0].text for page in pages) == refs["long_text"]
    assert all("The text continues" in page.warning for page in pages[:-1])


def test_a_part_a_raw_record_and_an_item_read_as_their_own_text(package: tuple[Path, str, dict[str, str]]) -> None:
    root, version, refs = package
    part = "".join(
        entry.text
        for page in every_page(root, version, action="read", ref=f"r_{refs['long']}:p1")
        for entry in page.entries
    )
    stored = (root / "snapshot" / "text" / f"{refs['long']}-1.txt").read_text()
    assert part == stored
    raw = "".join(
        entry.text
        for page in every_page(root, version, action="read", ref=f"r_{refs['long']}:raw")
        for entry in page.entries
    )
    assert json.loads(raw)["message"]["content"][0]["text"] == refs["long_text"]
    item_id = json.loads(refs["items"])[1]
    item = "".join(
        entry.text for page in every_page(root, version, action="read", ref=item_id) for entry in page.entries
    )
    assert item.startswith(f"[conflicts_todos / pending] item {item_id}\n联调待办")
    assert f"- r_{refs['b']}:p0 (session b, UTF-16 0-10)" in item
    assert f"- r_{refs['long']}:p2 (session a, UTF-16 0-10)" in item


def test_assets_images_text_too_large_and_unsupported(package: tuple[Path, str, dict[str, str]]) -> None:
    root, version, _ = package
    image_ref = "a_" + hashlib.sha256(PNG).hexdigest()
    image = call(root, version, action="asset", ref=image_ref)
    assert image.image is not None
    assert (image.image.media_type, image.image.data) == ("image/png", PNG)
    assert "the image is attached" in image.entries[0].text

    big_ref = "a_" + hashlib.sha256(b"\0" * 1_125_001).hexdigest()
    with pytest.raises(errors.AssetTooLarge) as too_large:
        call(root, version, action="asset", ref=big_ref)
    assert "it was not read; the original is kept" in too_large.value.message

    text_ref = "a_" + hashlib.sha256("笔记 ".encode() * 9000).hexdigest()
    text_pages = every_page(root, version, action="asset", ref=text_ref)
    assert len(text_pages) >= 2
    assert "".join(page.entries[-1].text for page in text_pages) == "笔记 " * 9000

    zip_ref = "a_" + hashlib.sha256(b"PK\3\4").hexdigest()
    archive = call(root, version, action="asset", ref=zip_ref)
    assert archive.image is None
    assert "application/zip is not supported here: it was not read" in archive.warning
