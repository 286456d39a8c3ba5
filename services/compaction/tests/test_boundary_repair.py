"""An invalid boundary (seed 001 §7.4, §11.5): drop the record, ignore its summary, load the full history
once, and compact again only when the normal trigger holds; never recurse or call the model twice."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from compaction_testing import Stack, running_stack
from transcript_testing import assistant, user

from continuum.compaction.events.v1 import events_pb2
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as tapi


async def _stage(stack: Stack, case: str) -> tuple[int, list[int]]:
    """A session with messages and a record whose boundary is invalid in the way `case` names."""
    await stack.new_session("s1")
    await stack.new_session("other")
    ids = await stack.append("s1", user("one"), assistant("1"), user("two"), assistant("2"), user("three"))
    if case == "missing":
        boundary = 10_000_000
    elif case == "other_session":
        boundary = (await stack.append("other", user("elsewhere")))[0]
    else:
        # Edit the second prompt: the messages after it are deleted, the boundary among them.
        boundary = ids[3]
        edit = tapi.EditUserMessageRequest(
            session_id="s1", message_id=ids[2], content=[tpb.ContentPart(text="two, again")]
        )
        await stack.transcript.stub.EditUserMessage(edit, metadata=stack.user())
        ids = ids[:3]
    await stack.put_record("s1", boundary, "STALE SUMMARY")
    return boundary, ids


@pytest.mark.parametrize("case", ["missing", "deleted", "other_session"])
async def test_invalid_boundary_falls_back_to_full_history_without_compacting(
    tmp_path: Path, database_url: str, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The trigger cannot hold: a huge window.
    async with running_stack(tmp_path, database_url, trigger_ratio=1.0) as stack:
        boundary, ids = await _stage(stack, case)
        with caplog.at_level(logging.WARNING, logger="continuum.compaction"):
            response = await stack.build("s1")

        assert response.compaction.boundary_was_invalid
        assert response.compaction.outcome == events_pb2.COMPACTION_OUTCOME_NOT_TRIGGERED
        assert [m.message_id for m in response.messages] == ids
        assert all("STALE SUMMARY" not in part.text for m in response.messages for part in m.content)
        assert await stack.record_rows("s1") == []
        assert stack.provider.calls == []
        warning = next(r for r in caplog.records if "boundary is invalid" in r.getMessage())
        assert warning.__dict__["boundary"] == boundary
        assert warning.__dict__["session_id"] == "s1"
        assert warning.__dict__["reason"] == ("deleted" if case == "deleted" else "missing")


@pytest.mark.parametrize("case", ["missing", "deleted", "other_session"])
async def test_invalid_boundary_compacts_again_once_when_the_trigger_holds(
    tmp_path: Path, database_url: str, case: str
) -> None:
    async with running_stack(tmp_path, database_url) as stack:
        _, ids = await _stage(stack, case)

        response = await stack.build("s1")

        assert response.compaction.boundary_was_invalid
        assert response.compaction.outcome == events_pb2.COMPACTION_OUTCOME_COMPACTED
        assert len(stack.provider.summarize_calls()) == 1
        rows = await stack.record_rows("s1")
        assert rows[0][0] == response.boundary_message_id
        assert "STALE SUMMARY" not in str(rows[0][1])
        assert [m.message_id for m in response.messages[1:]] == [i for i in ids if i > response.boundary_message_id]


async def test_repairing_a_large_history_stays_within_the_configured_batches(tmp_path: Path, database_url: str) -> None:
    async with running_stack(tmp_path, database_url, max_batch_messages=4, max_rounds_per_request=2) as stack:
        await stack.new_session("s1")
        ids: list[int] = []
        for n in range(30):
            ids += await stack.append("s1", user(f"request {n}"), assistant(f"answer {n}"))
        ids += await stack.append("s1", user("current"))
        await stack.put_record("s1", 10_000_000, "STALE SUMMARY")

        response = await stack.build("s1")

        # One full load, then at most max_rounds_per_request batches of whole turns; no recursion.
        assert response.compaction.boundary_was_invalid
        assert len(stack.provider.calls) == 2
        assert response.boundary_message_id == ids[7]
        assert [m.message_id for m in response.messages[1:]] == ids[8:]
