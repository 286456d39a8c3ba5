"""The reader over a package a real merge produced: transcript and merge servers on port 0, the
sources sealed, extracted by the offline provider and published; on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from deadline_testing import eventually
from merge_testing import MergeStack, running_merge
from test_search import call, every_page
from transcript_testing import append, assistant, tool, user

from continuum.merge.v1 import resources_pb2 as pb
from continuum_handoff_read import errors

FAST = {"worker_poll_seconds": 0.1, "lease_renew_seconds": 0.5, "lease_ttl_seconds": 5.0}
LONG_LINE = "x" * 100_000 + " TAIL_OF_A_LONG_TOOL_LINE"


@pytest.fixture
async def merged(tmp_path: Path, database_url: str) -> AsyncIterator[tuple[Path, str]]:
    """A completed merge of two sources (one with a subtask); its package directory and handoff hash."""
    async with running_merge(tmp_path, database_url, overrides=FAST) as stack:
        await stack.new_session("a", texts=1)
        await append(
            stack.transcript,
            "a",
            user("用户要求 把响应字段 name 改为 displayName"),
            assistant("editing services/api/handlers/user_profile.py", "call-a"),
            tool("call-a", LONG_LINE),
        )
        await stack.new_session("a-child", parent="a", texts=2)
        await stack.new_session("b", texts=1)
        await append(stack.transcript, "b", user("the frontend still reads name: 联调待办"))
        operation_id = (await stack.start(["a", "b"], title="Both")).operation.progress.operation_id
        await _completed(stack, operation_id)
        package = stack.settings.resolved_package_root() / operation_id
        yield package, hashlib.sha256((package / "handoff" / "ready.json").read_bytes()).hexdigest()


async def _completed(stack: MergeStack, operation_id: str) -> None:
    async def done() -> bool:
        status = (await stack.get(operation_id)).progress.status
        assert status in (pb.MERGE_STATUS_PREPARING, pb.MERGE_STATUS_COMPLETED)
        return status == pb.MERGE_STATUS_COMPLETED

    await eventually(done, what="the merge completed", seconds=90)


async def test_a_real_merge_package_lists_searches_and_reads(merged: tuple[Path, str]) -> None:
    package, version = merged

    def check() -> None:
        directory = [entry for page in every_page(package, version, action="list") for entry in page.entries]
        assert [entry.ref for entry in directory if entry.kind == "source"] == ["a", "b"]
        assert len([entry for entry in directory if entry.kind == "section"]) == 6

        chinese = call(package, version, action="search", query="改为 displayName")
        assert chinese.complete
        parts = [entry.ref for entry in chinese.entries if entry.kind == "part"]
        assert len(parts) == 1
        record = parts[0].split(":")[0]
        text = "".join(
            entry.text for page in every_page(package, version, action="read", ref=record) for entry in page.entries
        )
        assert "用户要求 把响应字段 name 改为 displayName" in text
        raw = call(package, version, action="read", ref=f"{record}:raw")
        assert '"role":"USER"' in raw.entries[0].text

        path = call(package, version, action="search", query="services/api/handlers/user_profile.py")
        assert any(entry.kind == "part" for entry in path.entries)
        tail = call(package, version, action="search", query="TAIL_OF_A_LONG_TOOL_LINE")
        assert [entry.ref.rsplit(":", 1)[1] for entry in tail.entries if entry.kind == "part"] == ["p3"]

        tree = call(package, version, action="list", source_id="a")
        sessions = {
            entry.text.split(" of session ")[1].split(" ")[0] for entry in tree.entries if entry.kind == "record"
        }
        assert sessions == {"a", "a-child"}
        in_b = call(package, version, action="search", query="联调待办", source_id="b")
        assert in_b.entries
        assert call(package, version, action="search", query="联调待办", source_id="a").entries == ()

        # The offline provider's extraction left items: each reads back with its evidence.
        items = [
            entry for entry in call(package, version, action="list", source_id="b").entries if entry.kind == "item"
        ]
        assert items
        item = call(package, version, action="read", ref=items[0].ref)
        assert "evidence:" in item.entries[0].text
        with pytest.raises(errors.RefNotFound):
            call(package, version, action="read", ref="r_" + "f" * 64)

    await asyncio.to_thread(check)
