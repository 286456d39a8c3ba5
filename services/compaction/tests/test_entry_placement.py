"""Where a merged session's reference entry goes in a request: after the summary, before the history,
never between a tool call and its result."""

from __future__ import annotations

from continuum.transcript.v1 import resources_pb2 as tpb
from continuum_compaction.handoff import ENTRY_KEY, HandoffEntry
from continuum_compaction.history import load_history
from continuum_compaction.request import build_request


def message(message_id: int, role: tpb.MessageRole.ValueType, text: str, call: str = "") -> tpb.Message:
    found = tpb.Message(message_id=message_id, session_id="s", role=role, content=[tpb.ContentPart(text=text)])
    if call and role == tpb.MESSAGE_ROLE_ASSISTANT:
        found.tool_calls.add(tool_call_id=call, name="Read", arguments="{}")
    if call and role == tpb.MESSAGE_ROLE_TOOL:
        found.tool_call_id = call
    return found


def test_the_entry_goes_after_the_summary_and_before_a_history_that_starts_with_a_stray_tool_result() -> None:
    history = load_history(
        10,
        [
            message(11, tpb.MESSAGE_ROLE_TOOL, "a result whose call was summarized", "gone"),
            message(12, tpb.MESSAGE_ROLE_USER, "go on"),
            message(13, tpb.MESSAGE_ROLE_ASSISTANT, "reading", "c1"),
            message(14, tpb.MESSAGE_ROLE_TOOL, "contents", "c1"),
        ],
    )
    entry = HandoffEntry("reference", None)

    built = build_request("s", [], [], "the summary", history, 8192, 8192, entry=entry)

    roles = [(m.message_id, m.role) for m in built.messages]
    assert roles == [
        (0, tpb.MESSAGE_ROLE_SYSTEM),
        (0, tpb.MESSAGE_ROLE_USER),
        (12, tpb.MESSAGE_ROLE_USER),
        (13, tpb.MESSAGE_ROLE_ASSISTANT),
        (14, tpb.MESSAGE_ROLE_TOOL),
    ]
    keys = [section.key for section in built.manifest.sections]
    assert keys == ["summary", ENTRY_KEY, "messages"]
    assert built.manifest.estimated_total_tokens == sum(s.estimated_tokens for s in built.manifest.sections)
