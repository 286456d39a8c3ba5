"""The final request, its manifest, the memory switch, Follow events, the summary read (seed 004 §5)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from compaction_testing import Stack, running_stack, runtime_events
from google.protobuf import field_mask_pb2, json_format
from transcript_testing import Follower, assistant, refused, user

from continuum.compaction.events.v1 import events_pb2
from continuum.compaction.v1 import compaction_service_pb2 as api
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as tapi
from continuum_compaction.errors import PageTokenInvalid
from continuum_compaction.servicer import EventsCursor
from continuum_runtime.paging import PageTokens
from continuum_runtime.provider import estimate_tokens

SECTIONS = [
    api.PromptSection(key="identity", label="Identity", text="You are a coding assistant.\n"),
    api.PromptSection(key="tools", label="Tools", text="\n## Tools\nUse the shell carefully. 工具说明\n"),
    api.PromptSection(key="workspace", label="Workspace", text="\n## Workspace\n/repo on main\n"),
]
MEMORIES = [api.MemoryEntry(memory_id="m-1", text="Prefers pytest"), api.MemoryEntry(memory_id="m-2", text="Uses uv")]


def _section(manifest: events_pb2.ContextManifest, key: str) -> events_pb2.ContextSection | None:
    return next((s for s in manifest.sections if s.key == key), None)


async def _set_memory_switch(stack: Stack, disabled: bool) -> None:
    await stack.transcript.stub.UpdateSession(
        tapi.UpdateSessionRequest(
            session=tpb.Session(session_id="s1", memory_injection_disabled=disabled),
            update_mask=field_mask_pb2.FieldMask(paths=["memory_injection_disabled"]),
        ),
        metadata=stack.user(),
    )


async def test_sections_join_to_the_system_prompt_byte_for_byte(stack: Stack) -> None:
    await stack.new_session("s1")
    ids = await stack.append("s1", user("a"), assistant("b"), user("c"))

    response = await stack.build("s1", system_prompt_sections=SECTIONS, memory_entries=MEMORIES)

    memory = _section(response.manifest, "memory")
    assert memory is not None and memory.count == 2
    texts = [s.text for s in SECTIONS]
    memory_text = response.system_prompt[len("".join(texts)) :]
    assert response.system_prompt == "".join([*texts, memory_text])
    assert "- Prefers pytest\n- Uses uv" in memory_text
    stats = {s.key: s.estimated_tokens for s in response.manifest.sections}
    for section in SECTIONS:
        assert stats[f"system:{section.key}"] == estimate_tokens(section.text)
    assert stats["memory"] == estimate_tokens(memory_text)
    assert list(response.manifest.memory_ids) == ["m-1", "m-2"]
    # The messages section describes exactly the returned history (summary excluded).
    messages = _section(response.manifest, "messages")
    summary = _section(response.manifest, "summary")
    assert messages is not None and summary is not None
    assert messages.count == len(response.messages) - 1 == len([i for i in ids if i > response.boundary_message_id])
    assert response.manifest.effective_window_tokens == stack.settings.context_window_tokens
    assert response.manifest.tokens_are_estimates
    assert response.manifest.estimated_total_tokens == sum(s.estimated_tokens for s in response.manifest.sections)


async def test_the_models_own_window_wins(stack: Stack) -> None:
    await stack.new_session("s1")
    await stack.append("s1", user("a"))

    response = await stack.build("s1", context_window_tokens=200_000)

    assert response.manifest.effective_window_tokens == 200_000


async def test_memory_switch_off_takes_effect_from_the_next_run(stack: Stack) -> None:
    await stack.new_session("s1")
    await stack.append("s1", user("a"))
    fields: dict[str, Any] = {"system_prompt_sections": SECTIONS, "memory_entries": MEMORIES}
    started = await stack.build("s1", run_id="run-1", **fields)
    await _set_memory_switch(stack, disabled=True)

    same_run = await stack.build("s1", run_id="run-1", trigger_point=api.TRIGGER_POINT_MID_LOOP, **fields)
    next_run = await stack.build("s1", run_id="run-2", **fields)
    next_run_mid = await stack.build("s1", run_id="run-2", trigger_point=api.TRIGGER_POINT_MID_LOOP, **fields)

    # The running run keeps what it started with; the next run has no memory section and no ids.
    assert list(started.manifest.memory_ids) == list(same_run.manifest.memory_ids) == ["m-1", "m-2"]
    for off in (next_run, next_run_mid):
        assert _section(off.manifest, "memory") is None
        assert list(off.manifest.memory_ids) == []
        assert off.system_prompt == "".join(s.text for s in SECTIONS)
    await _set_memory_switch(stack, disabled=False)
    on = await stack.build("s1", run_id="run-3", **fields)
    assert list(on.manifest.memory_ids) == ["m-1", "m-2"]


async def test_the_manifest_stays_within_8_kb_by_trimming_memory_ids(stack: Stack) -> None:
    await stack.new_session("s1")
    await stack.append("s1", user("a"))
    entries = [api.MemoryEntry(memory_id=f"memory-{n:03d}-" + "x" * 50, text=f"fact {n}") for n in range(64)]
    sections = [api.PromptSection(key=f"k{n:02d}-" + "y" * 60, label="L" * 80, text="t") for n in range(32)]

    response = await stack.build("s1", system_prompt_sections=sections, memory_entries=entries)

    assert len(json_format.MessageToJson(response.manifest, indent=None).encode()) <= 8192
    assert response.manifest.trimmed
    assert 0 < len(response.manifest.memory_ids) < 64
    assert list(response.manifest.memory_ids) == [e.memory_id for e in entries[: len(response.manifest.memory_ids)]]
    # The system prompt itself is never trimmed.
    assert _section(response.manifest, "memory") is not None and _section(response.manifest, "memory").count == 64  # type: ignore[union-attr]


async def test_compaction_and_context_window_events_reach_follow(stack: Stack) -> None:
    await stack.new_session("s1")
    await stack.append("s1", user("a"), assistant("b"), user("c"))
    follower = Follower(stack.transcript, "s1")
    await follower.until("snapshot_end")

    response = await stack.build("s1", system_prompt_sections=SECTIONS)

    events = await runtime_events(follower, 4)
    follower.close()
    kinds = ["compaction_started", "compaction_ended", "compaction_marker", "context_window"]
    assert [event.WhichOneof("event") for event in events] == kinds
    started, ended, marker, window = (getattr(event, kind) for event, kind in zip(events, kinds, strict=True))
    assert started.trigger_mode == marker.trigger_mode == events_pb2.TRIGGER_MODE_REQUEST_START
    assert ended.outcome == events_pb2.COMPACTION_OUTCOME_COMPACTED
    assert marker.boundary == ended.boundary_after == response.boundary_message_id
    assert window.estimated_tokens == response.manifest.estimated_total_tokens
    assert not window.HasField("actual_tokens")
    assert window.manifest == response.manifest


async def test_summary_read_is_empty_without_a_summary_and_full_after_one(stack: Stack) -> None:
    await stack.new_session("s1")
    assert not (await stack.summary("s1")).HasField("summary")
    await stack.append("s1", user("a"), assistant("b"), user("c"))
    built = await stack.build("s1")

    summary = (await stack.summary("s1")).summary

    assert summary.last_compacted_message_id == built.boundary_message_id
    assert summary.compact_count == 1
    assert summary.model == "scripted-1"
    assert summary.summary_text in built.messages[0].content[0].text
    assert summary.update_time.ToMilliseconds() > 0
    assert summary.input_tokens > 0


async def test_events_page_newest_first_with_opaque_tokens(tmp_path: Path, database_url: str) -> None:
    async with running_stack(tmp_path, database_url) as stack:
        await stack.new_session("s1")
        for n in range(3):
            await stack.append("s1", user(f"q{n}"), assistant(f"a{n}"))
            await stack.append("s1", user(f"next {n}"))
            await stack.build("s1", run_id=f"run-{n}")
        first = await stack.stub.ListCompactionEvents(
            api.ListCompactionEventsRequest(session_id="s1", page_size=2), metadata=stack.user()
        )
        second = await stack.stub.ListCompactionEvents(
            api.ListCompactionEventsRequest(session_id="s1", page_size=2, page_token=first.next_page_token),
            metadata=stack.user(),
        )
        ids = [e.event_id for e in [*first.events, *second.events]]
        assert ids == sorted(ids, reverse=True) and len(ids) == 3
        assert not second.next_page_token
        assert all(not e.summary_text for e in first.events)
        await refused(
            stack.stub.ListCompactionEvents(
                api.ListCompactionEventsRequest(session_id="other", page_token=first.next_page_token),
                metadata=stack.user(),
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "PAGE_TOKEN_INVALID",
        )


def _sections(count: int, text: str = "") -> list[api.PromptSection]:
    return [api.PromptSection(key=f"k{n}", label="L", text=text) for n in range(count)]


# (the field the refusal must name, the bad values); a field may be refused for several reasons.
BAD_BUILDS: list[tuple[str, dict[str, object]]] = [
    ("session_id", {"session_id": "bad id!"}),
    ("run_id", {"run_id": ""}),
    ("run_id", {"run_id": "r" * 129}),
    ("trigger_point", {"trigger_point": api.TRIGGER_POINT_UNSPECIFIED}),
    ("trigger_point", {"trigger_point": 99}),
    ("context_window_tokens", {"context_window_tokens": 10}),
    ("context_window_tokens", {"context_window_tokens": 10_000_001}),
    (
        "system_prompt_sections[1].key",
        {
            "system_prompt_sections": [
                api.PromptSection(key="a", label="A"),
                api.PromptSection(key="a", label="A again"),
            ]
        },
    ),
    ("system_prompt_sections[0].key", {"system_prompt_sections": [api.PromptSection(key="a b", label="A")]}),
    ("system_prompt_sections[0].label", {"system_prompt_sections": [api.PromptSection(key="a", label="")]}),
    ("system_prompt_sections[0].label", {"system_prompt_sections": [api.PromptSection(key="a", label="L" * 81)]}),
    ("system_prompt_sections", {"system_prompt_sections": _sections(33)}),
    ("system_prompt_sections", {"system_prompt_sections": _sections(2, "x" * (512 * 1024 + 1))}),
    ("memory_entries[0].text", {"memory_entries": [api.MemoryEntry(memory_id="m", text="  ")]}),
    ("memory_entries[0].text", {"memory_entries": [api.MemoryEntry(memory_id="m", text="x" * (16 * 1024 + 1))]}),
    ("memory_entries[0].memory_id", {"memory_entries": [api.MemoryEntry(memory_id="", text="x")]}),
    (
        "memory_entries[1].memory_id",
        {"memory_entries": [api.MemoryEntry(memory_id="m", text="x"), api.MemoryEntry(memory_id="m", text="y")]},
    ),
    ("memory_entries", {"memory_entries": [api.MemoryEntry(memory_id=f"m{n}", text="x") for n in range(65)]}),
]


@pytest.mark.parametrize(("field", "bad"), BAD_BUILDS, ids=[f"{field}-{n}" for n, (field, _) in enumerate(BAD_BUILDS)])
async def test_bad_build_context_input_is_refused_and_changes_nothing(
    stack: Stack, field: str, bad: dict[str, object]
) -> None:
    await stack.new_session("s1")
    await stack.append("s1", user("a"), assistant("b"), user("c"))
    values: dict[str, object] = {
        "session_id": "s1",
        "run_id": "run-1",
        "trigger_point": api.TRIGGER_POINT_REQUEST_START,
    }
    values.update(bad)

    error = await refused(
        stack.stub.BuildContext(api.BuildContextRequest(**values), metadata=stack.user()),  # type: ignore[arg-type]
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_ARGUMENT",
    )

    assert [v.field for v in error.violations] == [field]
    assert stack.provider.calls == []
    assert await stack.record_rows("s1") == []


@pytest.mark.parametrize(
    ("rpc", "request_"),
    [
        ("CompactNow", api.CompactNowRequest(session_id="")),
        ("CompactNow", api.CompactNowRequest(session_id="s1", context_window_tokens=-5)),
        ("GetCompactionSummary", api.GetCompactionSummaryRequest(session_id="x" * 65)),
        ("ListCompactionEvents", api.ListCompactionEventsRequest(session_id="s1", page_size=-1)),
    ],
)
async def test_bad_input_of_other_rpcs_is_refused(stack: Stack, rpc: str, request_: object) -> None:
    await stack.new_session("s1")

    await refused(
        getattr(stack.stub, rpc)(request_, metadata=stack.user()), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"
    )

    assert stack.provider.calls == []


async def test_unknown_session_is_not_found(stack: Stack) -> None:
    await refused(stack.build("nope"), grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND")


async def test_a_call_without_an_acting_user_is_refused(stack: Stack) -> None:
    await stack.new_session("s1")
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stack.stub.GetCompactionSummary(
            api.GetCompactionSummaryRequest(session_id="s1"), metadata=stack.transcript.system
        )
    assert raised.value.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT)


async def test_long_labels_are_shortened_when_the_manifest_would_pass_8_kb(stack: Stack) -> None:
    await stack.new_session("s1")
    await stack.append("s1", user("a"))
    sections = [api.PromptSection(key=f"section-{n:02d}", label="说明" * 40, text="t") for n in range(32)]

    response = await stack.build("s1", system_prompt_sections=sections)

    assert len(json_format.MessageToJson(response.manifest, indent=None).encode()) <= 8192
    assert response.manifest.trimmed
    assert [s.key for s in response.manifest.sections][:32] == [f"system:section-{n:02d}" for n in range(32)]
    assert response.system_prompt == "t" * 32


async def test_a_forged_page_token_is_refused(stack: Stack) -> None:
    await stack.new_session("s1")
    parameters = {"rpc": "ListCompactionEvents", "user": "alice", "session_id": "s1", "include_summary_text": False}
    # Signed with another secret, an unsigned cursor of the previous format, and plain garbage.
    other_deployment = PageTokens(b"another deployment's secret", EventsCursor, PageTokenInvalid)
    unsigned = base64.urlsafe_b64encode(json.dumps({"c": 5, "p": "0" * 16}).encode()).decode()
    for forged in (other_deployment.issue(EventsCursor(before_event_id=5), parameters), unsigned, "garbage", "a.b"):
        error = await refused(
            stack.stub.ListCompactionEvents(
                api.ListCompactionEventsRequest(session_id="s1", page_token=forged), metadata=stack.user()
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "PAGE_TOKEN_INVALID",
        )
        assert [v.field for v in error.violations] == ["page_token"]
