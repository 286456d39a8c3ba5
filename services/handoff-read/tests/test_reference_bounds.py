"""The reference entry stays within its budget however large the handoff it is built from."""

from __future__ import annotations

import pytest

from continuum_handoff_read.reference import SECTION_ORDER, build, entry_tokens

VERSION = "f" * 64


def big_handoff(items: int, sources: int) -> tuple[dict[str, object], dict[str, object]]:
    """overview.json and brief.json as merge's handoff writer shapes them, far over any entry budget."""
    by_source = {
        f"source-{n}": {"goals_constraints": {"recorded": 3}, "conflicts_todos": {"pending": 2}} for n in range(sources)
    }
    brief_items = [
        {
            "itemId": f"item-{n}",
            "section": SECTION_ORDER[n % len(SECTION_ORDER)],
            "status": "recorded",
            "content": f"item {n}: " + "长文本 and src/module_{n}.py " * 80,
            "evidence": ["details.jsonl"],
        }
        for n in range(items)
    ]
    return {"bySource": by_source}, {"items": brief_items, "notExpanded": 12_345}


@pytest.mark.parametrize("max_tokens", [200, 512, 2048])
def test_a_huge_brief_fills_the_budget_and_counts_the_rest(max_tokens: int) -> None:
    overview, brief = big_handoff(items=20_000, sources=5)

    entry = build(VERSION, overview, brief, max_tokens)

    assert entry.estimated_tokens == entry_tokens(entry.text) <= max_tokens
    shown = entry.text.count("\n- [")
    assert entry.items_not_expanded == 20_000 - shown + 12_345
    assert f"{entry.items_not_expanded} more items not expanded" in entry.text
    # Goals and constraints come first: every item shown is of the first section while it lasts.
    assert all(line.startswith("- [goal/constraint") for line in entry.text.splitlines() if line.startswith("- ["))


def test_a_small_handoff_fits_whole_with_nothing_left_unexpanded() -> None:
    overview = {"bySource": {"a": {"conflicts_todos": {"pending": 1}}}}
    brief = {"items": [{"section": "conflicts_todos", "status": "pending", "content": "write the client"}]}

    entry = build(VERSION, overview, brief, 2048)

    assert "Source a: open item 1." in entry.text
    assert "- [open item / pending] write the client" in entry.text
    assert entry.items_not_expanded == 0
    assert "not expanded" not in entry.text
