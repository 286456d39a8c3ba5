"""The offline provider's answers to structured-item requests (`continuum_runtime.provider.structured`)."""

from __future__ import annotations

import json
from typing import Any, Literal

import pytest

from continuum_runtime.provider import (
    HINT_KINDS,
    ChatMessage,
    OfflineProvider,
    ProviderOutputTruncated,
    parse_structured_request,
    structured_header,
)

SECTIONS = ("goals", "state", "checks", "todos")
STATUSES = ("recorded", "failed", "pending", "unverified")
HINTS = {
    "error": ("checks", "failed"),
    "command": ("checks", "unverified"),
    "file": ("state", "recorded"),
    "note": ("todos", "pending"),
    "request": ("goals", "recorded"),
    "other": ("state", "recorded"),
}


def request(mode: Literal["extract", "condense"], inputs: list[dict[str, Any]]) -> list[ChatMessage]:
    header = structured_header(mode, sections=SECTIONS, statuses=STATUSES, hints=HINTS)
    return [
        ChatMessage("system", header + "\nInstructions for a real model."),
        ChatMessage("user", json.dumps({"inputs": inputs})),
    ]


async def answer(messages: list[ChatMessage], max_output_tokens: int | None = None) -> dict[str, Any]:
    completion = await OfflineProvider().complete(messages, max_output_tokens=max_output_tokens)
    payload: dict[str, Any] = json.loads(completion.text)
    return payload


async def test_extract_files_each_input_by_the_kind_of_its_most_telling_line() -> None:
    inputs: list[dict[str, Any]] = [
        {"alias": "i1", "role": "user", "text": "Rename the field to displayName.\nKeep the old name readable."},
        {"alias": "i2", "role": "tool", "text": "collected 3 items\nE   AssertionError: name missing"},
        {"alias": "i3", "role": "assistant", "text": "$ pytest tests/test_api.py -q"},
        {"alias": "i4", "role": "assistant", "text": "I changed api/schema.py for the new field."},
        {"alias": "i5", "role": "assistant", "text": "TODO: the front end still reads the old field"},
        {"alias": "i6", "role": "assistant", "text": "Looked around."},
        {"alias": "i7", "role": "assistant", "text": "  \n"},
        {"alias": "i8", "role": "user", "text": "Shown for continuity only.", "context": True},
    ]
    payload = await answer(request("extract", inputs))
    assert payload["schemaVersion"] == 2
    filed = [(item["evidence"], item["section"], item["status"]) for item in payload["items"]]
    assert filed == [
        (["i1"], "goals", "recorded"),
        (["i2"], "checks", "failed"),
        (["i3"], "checks", "unverified"),
        (["i4"], "state", "recorded"),
        (["i5"], "todos", "pending"),
        (["i6"], "state", "recorded"),
    ]
    assert payload["items"][1]["content"] == "tool: E   AssertionError: name missing"
    # Same request, same answer.
    assert await answer(request("extract", inputs)) == payload


async def test_condense_groups_items_by_section_and_status_and_cites_every_member() -> None:
    inputs: list[dict[str, Any]] = [
        {"alias": f"a{n}", "section": "checks", "status": "failed", "content": f"check {n} failed"} for n in range(5)
    ] + [{"alias": "a9", "section": "goals", "status": "recorded", "content": "ship it " + "x" * 100}]
    payload = await answer(request("condense", inputs))
    assert payload["items"] == [
        {
            "section": "checks",
            "status": "failed",
            "content": "5 items: check 0 failed | check 1 failed | check 2 failed | +2 more",
            "evidence": ["a0", "a1", "a2", "a3", "a4"],
        },
        {"section": "goals", "status": "recorded", "content": "ship it " + "x" * 71 + "…", "evidence": ["a9"]},
    ]


async def test_items_left_out_to_fit_the_output_limit_and_truncation_when_none_fits() -> None:
    inputs = [{"alias": f"i{n}", "role": "user", "text": "x" * 400} for n in range(1, 6)]
    payload = await answer(request("extract", inputs), max_output_tokens=300)
    assert 1 <= len(payload["items"]) < 5
    assert [item["evidence"] for item in payload["items"]] == [[f"i{n}"] for n in range(1, len(payload["items"]) + 1)]
    with pytest.raises(ProviderOutputTruncated):
        await answer(request("extract", inputs), max_output_tokens=20)


async def test_prose_requests_keep_the_extractive_summary() -> None:
    messages = [ChatMessage("system", "Summarize."), ChatMessage("user", "Fix the bug in app.py")]
    assert parse_structured_request(messages) is None
    completion = await OfflineProvider().complete(messages)
    assert completion.text.startswith("Extractive summary by the offline provider")


def test_malformed_structured_requests_are_refused() -> None:
    header = structured_header("extract", sections=SECTIONS, statuses=STATUSES, hints=HINTS)
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_structured_request([ChatMessage("system", header), ChatMessage("user", "not json")])
    with pytest.raises(ValueError, match="inputs are malformed"):
        parse_structured_request([ChatMessage("system", header), ChatMessage("user", '{"inputs": [{"x": 1}]}')])
    with pytest.raises(ValueError, match="lacks hints"):
        structured_header("extract", sections=SECTIONS, statuses=STATUSES, hints={"error": ("checks", "failed")})
    with pytest.raises(ValueError, match="does not list"):
        structured_header(
            "extract", sections=SECTIONS, statuses=STATUSES, hints={kind: ("nowhere", "failed") for kind in HINT_KINDS}
        )
