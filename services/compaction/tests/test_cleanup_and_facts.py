"""Deleted sessions leave nothing behind (seed 001 §7.12); summaries keep must-survive facts; the
built-in offline provider and the real HTTP client both drive a whole compaction."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from compaction_testing import ScriptedProvider, Stack, running_stack
from deadline_testing import eventually
from transcript_testing import assistant, tool, user

from continuum.compaction.events.v1 import events_pb2
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as tapi
from continuum_compaction.cleanup import reconcile
from continuum_compaction.server import open_transcript
from continuum_runtime.provider import OFFLINE_MODEL, ChatMessage


async def _compacted_session(stack: Stack, session_id: str) -> None:
    await stack.new_session(session_id)
    await stack.append(session_id, user("a"), assistant("b"), user("c"))
    await stack.build(session_id)
    assert await stack.record_rows(session_id)


async def test_deleting_a_session_removes_its_record(stack: Stack) -> None:
    await _compacted_session(stack, "s1")
    await _compacted_session(stack, "keep")

    await stack.transcript.stub.DeleteSession(tapi.DeleteSessionRequest(session_id="s1"), metadata=stack.user())

    async def gone() -> bool:
        return await stack.record_rows("s1") == []

    await eventually(gone)
    assert await stack.record_rows("keep")


async def test_the_cleanup_command_reconciles_what_the_consumer_missed(tmp_path: Path, database_url: str) -> None:
    async with running_stack(tmp_path, database_url, consume_session_events=False) as stack:
        await _compacted_session(stack, "s1")
        await _compacted_session(stack, "keep")
        await stack.transcript.stub.DeleteSession(tapi.DeleteSessionRequest(session_id="s1"), metadata=stack.user())
        assert await stack.record_rows("s1")

        transcript = open_transcript(stack.settings)
        try:
            deleted, removed = await reconcile(stack.database, transcript)
        finally:
            await transcript.close()

        assert deleted == 1 and removed >= 2  # the record and its event
        assert await stack.record_rows("s1") == []
        assert await stack.record_rows("keep")


async def test_missing_facts_get_one_retry_then_are_appended(tmp_path: Path, database_url: str) -> None:
    provider = ScriptedProvider(reply=lambda _: "The user worked on the parser.")
    async with running_stack(tmp_path, database_url, provider) as stack:
        await stack.new_session("s1")
        shell = tpb.ToolCall(tool_call_id="c1", name="shell", arguments=json.dumps({"command": "pytest -x tests/"}))
        await stack.append(
            "s1",
            user("Fix src/parser.py and never touch the public API."),
            tpb.NewMessage(
                role=tpb.MESSAGE_ROLE_ASSISTANT, content=[tpb.ContentPart(text="on it")], tool_calls=[shell]
            ),
            tool("c1", "FAILED tests/test_parser.py::test_empty - ValueError: empty input"),
            assistant("TODO: handle empty input"),
        )
        await stack.append("s1", user("continue"))

        response = await stack.build("s1")

        # One first attempt and one corrective retry, no more.
        assert len(provider.calls) == 2
        assert provider.calls[1][-1].content.startswith("The summary lost these facts")
        summary = response.messages[0].content[0].text
        assert "Preserved facts (kept verbatim by Continuum):" in summary
        for fact in ("src/parser.py", "pytest -x tests/", "ValueError: empty input", "TODO: handle empty input"):
            assert fact in summary
        assert response.compaction.facts_found >= 5
        assert response.compaction.facts_kept == 0


async def test_the_offline_provider_compacts_end_to_end(tmp_path: Path, database_url: str) -> None:
    async with running_stack(tmp_path, database_url, configured_provider=True) as stack:
        await stack.new_session("s1")
        for n in range(3):
            await stack.append("s1", user(f"Edit docs/guide-{n}.md please."), assistant(f"Edited guide {n}."))
        await stack.append("s1", user("now"))
        first = await stack.build("s1")
        await stack.append("s1", assistant("ok"), user("and more"))
        second = await stack.build("s1", run_id="run-2")

        assert first.compaction.outcome == second.compaction.outcome == events_pb2.COMPACTION_OUTCOME_COMPACTED
        summary = second.messages[0].content[0].text
        assert "offline provider" in summary
        # Folded forward: what the first batch found is still there after the second.
        for n in range(3):
            assert f"docs/guide-{n}.md" in summary
        record = (await stack.summary("s1")).summary
        assert record.model == OFFLINE_MODEL and record.compact_count == 2


def _first_batch_keeps_paths(messages: Sequence[ChatMessage]) -> str:
    # Batch 1 (no earlier summary) mentions the path; batch 2 forgets it, as models do.
    return "Work on src/parser.py." if messages[1].role != "assistant" else "Later work."


async def test_facts_of_earlier_batches_must_survive_later_ones(tmp_path: Path, database_url: str) -> None:
    provider = ScriptedProvider(reply=_first_batch_keeps_paths)
    async with running_stack(tmp_path, database_url, provider, max_batch_messages=2) as stack:
        await stack.new_session("s1")
        await stack.append("s1", user("Open src/parser.py"), assistant("opened"))
        await stack.append("s1", user("Now something else"), assistant("done"))
        await stack.append("s1", user("current"))

        response = await stack.build("s1")

        summary = response.messages[0].content[0].text
        assert "Later work." in summary
        assert "- path: src/parser.py" in summary
        assert response.compaction.facts_found == 1 and response.compaction.facts_kept == 0


async def test_preserved_facts_survive_the_next_compaction(tmp_path: Path, database_url: str) -> None:
    provider = ScriptedProvider(reply=lambda _: "Plain summary.")
    async with running_stack(tmp_path, database_url, provider) as stack:
        await stack.new_session("s1")
        await stack.append("s1", user("Edit lib/core.rs"), assistant("ok"), user("next"))
        first = await stack.build("s1")
        assert "- path: lib/core.rs" in first.messages[0].content[0].text
        await stack.append("s1", assistant("fine"), user("more"))

        second = await stack.build("s1", run_id="run-2")

        assert second.compaction.outcome == events_pb2.COMPACTION_OUTCOME_COMPACTED
        assert "- path: lib/core.rs" in second.messages[0].content[0].text


async def test_a_failed_corrective_retry_keeps_the_first_summary(tmp_path: Path, database_url: str) -> None:
    provider = ScriptedProvider(reply=lambda _: "Forgetful summary.", fail_calls={1})
    async with running_stack(tmp_path, database_url, provider) as stack:
        await stack.new_session("s1")
        await stack.append("s1", user("Fix app/main.py"), assistant("fixed"), user("next"))

        response = await stack.build("s1")

        assert len(provider.calls) == 2
        assert response.compaction.outcome == events_pb2.COMPACTION_OUTCOME_COMPACTED
        summary = response.messages[0].content[0].text
        assert "Forgetful summary." in summary and "- path: app/main.py" in summary


async def test_a_turn_too_large_for_the_model_is_summarized_with_shorter_clips(
    tmp_path: Path, database_url: str
) -> None:
    provider = ScriptedProvider(max_prompt_chars=6000)
    async with running_stack(tmp_path, database_url, provider) as stack:
        await stack.new_session("s1")
        big = [tool(f"c{n}", "x" * 3000) for n in range(3)]
        calls = await stack.append("s1", user("scan"), assistant("scanning", "c0", "c1", "c2"), *big)
        await stack.append("s1", user("current"))

        response = await stack.build("s1")

        assert response.compaction.outcome == events_pb2.COMPACTION_OUTCOME_COMPACTED
        assert response.boundary_message_id == calls[-1]
        assert len(provider.calls) == 2  # refused once, accepted with shorter clips
