"""The agent's memory file: parsing, stable ids, bounds, confinement, and the entries a turn's requests
carry (as the context manifest in the Follow stream shows them), switched off from the next run."""

from __future__ import annotations

import os
from pathlib import Path

from agent_testing import AgentStack
from compaction_testing import OWNER
from google.protobuf import field_mask_pb2
from test_run_state import IDLE, Watcher

from continuum.compaction.events.v1.events_pb2 import ContextManifest
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as tapi
from continuum_agent.memory import MemoryLimits, load, memory_id, parse, select
from continuum_agent.tools import Workspace

LIMITS = MemoryLimits("MEMORY.md", 64 * 1024, 32, 2048, 16 * 1024)
MEMORY = """# What to remember

- The profile field is `displayName`; `name` is being retired.
* Migrations live in server/migrations and are
  numbered with four digits.

Prose between entries is not an entry.
-   The profile field is `displayName`;   `name` is being retired.
"""


def _workspace(root: Path) -> Workspace:
    workspace = Workspace.of(str(root), 4096)
    assert workspace is not None
    return workspace


def test_one_entry_per_bullet_with_its_indented_lines_and_ids_from_the_text() -> None:
    entries = parse(MEMORY)

    assert entries == [
        "The profile field is `displayName`; `name` is being retired.",
        "Migrations live in server/migrations and are numbered with four digits.",
        "The profile field is `displayName`; `name` is being retired.",
    ]
    chosen = select(entries, LIMITS)
    # The repeated entry counts once; ids depend on the text only.
    assert [e.memory_id for e in chosen] == [memory_id(entries[0]), memory_id(entries[1])]
    assert memory_id(entries[0]) == memory_id("The profile field is `displayName`; `name` is being retired.")
    assert memory_id(entries[0]).startswith("mem-") and len(memory_id(entries[0])) == 20


def test_a_big_memory_file_is_read_only_up_to_its_limits(tmp_path: Path) -> None:
    # 10 MiB of bullets, one of them far too long.
    lines = ["- " + "x" * 5000] + [f"- entry {i} " + "y" * 80 for i in range(100_000)]
    (tmp_path / "MEMORY.md").write_text("\n".join(lines) + "\n")

    chosen = load(_workspace(tmp_path), LIMITS)

    # The over-long entry is left out; then file order until the count limit.
    assert [e.text.split()[1] for e in chosen] == [str(i) for i in range(32)]
    small = MemoryLimits("MEMORY.md", 64 * 1024, 64, 2048, 1000)
    chosen = load(_workspace(tmp_path), small)
    assert sum(len(e.text.encode()) for e in chosen) <= 1000 and len(chosen) == 11
    # A file cut at its byte limit ends at a whole line, so no entry is cut in half.
    cut = MemoryLimits("MEMORY.md", 5000 + 3 + 150, 64, 2048, 16 * 1024)
    assert [e.text for e in load(_workspace(tmp_path), cut)] == ["entry 0 " + "y" * 80]


def test_no_memory_without_a_file_or_through_a_link_out_of_the_working_directory(tmp_path: Path) -> None:
    inside = tmp_path / "work"
    inside.mkdir()
    assert load(_workspace(inside), LIMITS) == []
    assert load(None, LIMITS) == []
    (tmp_path / "secret.md").write_text("- outside\n")
    os.symlink(tmp_path / "secret.md", inside / "MEMORY.md")
    assert load(_workspace(inside), LIMITS) == []
    (inside / "MEMORY.md").unlink()
    (inside / "MEMORY.md").mkdir()
    assert load(_workspace(inside), LIMITS) == []


def _manifests(frames: list[tapi.FollowResponse]) -> list[ContextManifest]:
    return [
        event.context_window.manifest
        for frame in frames
        if frame.WhichOneof("frame") == "batch"
        for event in frame.batch.events
        if event.HasField("context_window")
    ]


async def test_every_request_of_a_turn_carries_the_memory_until_the_switch_turns_it_off(agent: AgentStack) -> None:
    (agent.workdir / "MEMORY.md").write_text(MEMORY)
    expected = [memory_id(e) for e in parse(MEMORY)[:2]]
    await agent.new_session("s1")

    watcher = Watcher(agent, "s1")
    try:
        await agent.start_turn("s1", "look around")
        await watcher.state(IDLE)
        manifests = _manifests(watcher.frames)
        # Two requests: before the tool round and after it.
        assert len(manifests) == 2
        for manifest in manifests:
            assert list(manifest.memory_ids) == expected
            [section] = [s for s in manifest.sections if s.key == "memory"]
            assert section.count == 2

        session = tpb.Session(session_id="s1", memory_injection_disabled=True)
        await agent.services.transcript.stub.UpdateSession(
            tapi.UpdateSessionRequest(
                session=session, update_mask=field_mask_pb2.FieldMask(paths=["memory_injection_disabled"])
            ),
            metadata=agent.user(OWNER),
        )
        seen = len(watcher.frames)
        await agent.wait_idle("s1")
        await agent.start_turn("s1", "again")
        await watcher.state(IDLE)
        manifests = _manifests(watcher.frames[seen:])
        assert len(manifests) == 2
        assert all(not m.memory_ids and all(s.key != "memory" for s in m.sections) for m in manifests)
    finally:
        watcher.close()
