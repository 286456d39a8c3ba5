"""BuildContext over real transcript and compaction servers: boundary semantics, reuse, turn integrity."""

from __future__ import annotations

from pathlib import Path

import pytest
from compaction_testing import RecordingProxy, ScriptedProvider, Stack, running_stack, summarized_ids
from transcript_testing import assistant, tool, user

from continuum.compaction.events.v1 import events_pb2
from continuum.compaction.v1 import compaction_service_pb2 as api
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as tapi


def ids_of(response: api.BuildContextResponse) -> list[int]:
    """Real ids of the history messages (the summary message has id 0)."""
    return [message.message_id for message in response.messages if message.message_id]


async def test_first_compaction_stores_the_real_id_of_the_last_covered_message(
    tmp_path: Path, database_url: str
) -> None:
    # One id per reservation, so sessions written in turn really get interleaved ids.
    async with running_stack(tmp_path, database_url, transcript_overrides={"publisher_id_block": 1}) as stack:
        await _first_compaction(stack)


async def _first_compaction(stack: Stack) -> None:
    await stack.new_session("s1")
    await stack.new_session("other")
    # Interleave another session so the ids of s1 are not contiguous.
    first = await stack.append("s1", user("build the parser"), assistant("done"))
    await stack.append("other", user("x"), assistant("y"))
    second = await stack.append("s1", user("add tests"), assistant("added"))
    await stack.append("other", user("x"), assistant("y"))
    current = await stack.append("s1", user("now refactor"))

    response = await stack.build("s1")

    assert response.compaction.outcome == events_pb2.COMPACTION_OUTCOME_COMPACTED
    assert response.compaction.trigger_mode == events_pb2.TRIGGER_MODE_REQUEST_START
    assert response.compaction.boundary_after == second[-1]
    assert second[-1] - first[-1] > 2  # really non-contiguous
    assert (await stack.record_rows("s1"))[0][0] == second[-1]
    # The summary comes first as one SYSTEM message, then only messages after the boundary.
    assert response.messages[0].role == tpb.MESSAGE_ROLE_SYSTEM and response.messages[0].message_id == 0
    assert ids_of(response) == current
    assert response.boundary_message_id == second[-1]
    assert [summarized_ids(call) for call in stack.provider.summarize_calls()] == [[*first, *second]]


async def test_later_requests_load_only_messages_after_the_boundary_of_this_session(stack: Stack) -> None:
    await stack.new_session("s1")
    await stack.new_session("other")
    await stack.append("s1", user("a"), assistant("b"))
    await stack.append("s1", user("c"))
    compacted = await stack.build("s1")
    boundary = compacted.boundary_message_id
    await stack.append("other", user("later, bigger ids"), assistant("elsewhere"))
    tail = await stack.append("s1", assistant("reply"), user("next"))

    response = await stack.build("s1", run_id="run-2", skip_auto_compaction=True)

    assert all(message.session_id == "s1" for message in response.messages)
    assert ids_of(response) == [i for i in [*ids_of(compacted), *tail] if i > boundary]
    assert response.messages[0].role == tpb.MESSAGE_ROLE_SYSTEM
    assert response.compaction.outcome == events_pb2.COMPACTION_OUTCOME_NOT_TRIGGERED


async def test_existing_summary_is_injected_when_auto_compaction_is_off(tmp_path: Path, database_url: str) -> None:
    async with running_stack(tmp_path, database_url, auto_compaction=False) as stack:
        await stack.new_session("s1")
        ids = await stack.append("s1", user("a"), assistant("b"), user("c"))
        await stack.put_record("s1", ids[1], "the earlier work")

        response = await stack.build("s1")

        assert stack.provider.calls == []
        assert response.compaction.outcome == events_pb2.COMPACTION_OUTCOME_NOT_TRIGGERED
        assert "the earlier work" in response.messages[0].content[0].text
        assert ids_of(response) == [ids[2]]


async def test_no_summary_and_auto_compaction_off_loads_the_full_history(tmp_path: Path, database_url: str) -> None:
    async with running_stack(tmp_path, database_url, auto_compaction=False) as stack:
        await stack.new_session("s1")
        ids = await stack.append("s1", user("a"), assistant("b"), user("c"))

        response = await stack.build("s1")

        assert stack.provider.calls == []
        assert ids_of(response) == ids
        assert all(message.role != tpb.MESSAGE_ROLE_SYSTEM for message in response.messages)


async def test_summary_is_reused_when_this_request_does_not_compact(tmp_path: Path, database_url: str) -> None:
    async with running_stack(tmp_path, database_url, trigger_ratio=1.0) as stack:
        await stack.new_session("s1")
        ids = await stack.append("s1", user("a"), assistant("b"), user("c"))
        await stack.put_record("s1", ids[1], "kept summary")

        response = await stack.build("s1")

        assert response.compaction.outcome == events_pb2.COMPACTION_OUTCOME_NOT_TRIGGERED
        assert stack.provider.calls == []
        assert "kept summary" in response.messages[0].content[0].text
        assert ids_of(response) == [ids[2]]


async def test_tool_rounds_stay_whole_and_the_current_turn_is_kept_with_zero_recent_turns(stack: Stack) -> None:
    await stack.new_session("s1")
    turn = await stack.append(
        "s1",
        user("fix the bug"),
        assistant("looking", "call-a", "call-b"),
        tool("call-a", "file contents"),
        tool("call-b", "test output"),
        assistant("fixed"),
    )
    current = await stack.append("s1", user("thanks, now docs"), assistant("writing docs"))

    response = await stack.build("s1")

    assert response.boundary_message_id == turn[-1]
    assert ids_of(response) == current


async def test_recent_turns_stay_verbatim(tmp_path: Path, database_url: str) -> None:
    async with running_stack(tmp_path, database_url, recent_turns=1) as stack:
        await stack.new_session("s1")
        old = await stack.append("s1", user("one"), assistant("1"))
        recent = await stack.append("s1", user("two"), assistant("2", "call-x"), tool("call-x", "out"), assistant("ok"))
        current = await stack.append("s1", user("three"))

        response = await stack.build("s1")

        assert response.boundary_message_id == old[-1]
        assert ids_of(response) == [*recent, *current]


async def test_a_tool_result_stored_before_its_assistant_is_cut_by_real_ids(stack: Stack) -> None:
    await stack.new_session("s1")
    prompt = await stack.append("s1", user("run it"))
    result = await stack.append("s1", tool("call-1", "ran"))
    call = await stack.append("s1", assistant("running", "call-1"), assistant("it ran"))
    current = await stack.append("s1", user("next"))

    response = await stack.build("s1")

    assert response.boundary_message_id == call[-1]
    assert summarized_ids(stack.provider.summarize_calls()[0]) == [prompt[0], call[0], result[0], call[1]]
    assert ids_of(response) == current


async def test_only_the_current_turn_means_nothing_to_compact(stack: Stack) -> None:
    await stack.new_session("s1")
    await stack.append("s1", user("first request"), assistant("working"))

    response = await stack.build("s1")

    assert stack.provider.calls == []
    assert response.compaction.outcome in (
        events_pb2.COMPACTION_OUTCOME_NOT_TRIGGERED,
        events_pb2.COMPACTION_OUTCOME_NOTHING_TO_COMPACT,
    )
    assert (await stack.record_rows("s1")) == []


async def test_a_failing_middle_batch_keeps_the_successful_prefix(tmp_path: Path, database_url: str) -> None:
    provider = ScriptedProvider(fail_calls={1})
    async with running_stack(tmp_path, database_url, provider, max_batch_messages=2) as stack:
        await stack.new_session("s1")
        first = await stack.append("s1", user("one"), assistant("1"))
        second = await stack.append("s1", user("two"), assistant("2"))
        third = await stack.append("s1", user("three"), assistant("3"))
        current = await stack.append("s1", user("four"))

        response = await stack.build("s1")

        # Batch 2 failed, so batch 3 was never attempted; batch 1 is persisted.
        assert len(provider.calls) == 2
        assert response.compaction.outcome == events_pb2.COMPACTION_OUTCOME_COMPACTED
        assert response.boundary_message_id == first[-1]
        assert ids_of(response) == [*second, *third, *current]

        retried = await stack.build("s1", run_id="run-2")

        assert retried.boundary_message_id == third[-1]
        assert ids_of(retried) == current


async def test_a_single_turn_over_the_batch_limit_is_its_own_batch(tmp_path: Path, database_url: str) -> None:
    async with running_stack(tmp_path, database_url, max_batch_messages=2) as stack:
        await stack.new_session("s1")
        big = await stack.append(
            "s1",
            user("big"),
            assistant("a", "c1"),
            tool("c1", "r"),
            assistant("b", "c2"),
            tool("c2", "r"),
            assistant("z"),
        )
        small = await stack.append("s1", user("small"), assistant("s"))
        await stack.append("s1", user("current"))

        response = await stack.build("s1")

        assert [summarized_ids(call) for call in stack.provider.summarize_calls()] == [big, small]
        assert response.boundary_message_id == small[-1]


async def test_no_safe_prefix_persists_nothing_and_pays_for_no_summary(tmp_path: Path, database_url: str) -> None:
    async with running_stack(tmp_path, database_url, recent_turns=1) as stack:
        await stack.new_session("s1")
        # The first turn's tool result is stored after the second turn started: the first turn's
        # largest id lies beyond messages of a kept turn, so no boundary covers exactly the candidates.
        await stack.append("s1", user("one"), assistant("calling", "late"))
        await stack.append("s1", user("two"), assistant("2"))
        await stack.append("s1", tool("late", "result"))
        await stack.append("s1", user("three"))

        response = await stack.build("s1")

        assert stack.provider.calls == []
        assert response.compaction.outcome == events_pb2.COMPACTION_OUTCOME_NOT_TRIGGERED
        assert (await stack.record_rows("s1")) == []


async def test_candidates_stop_at_the_last_turn_a_safe_boundary_can_follow(stack: Stack) -> None:
    await stack.new_session("s1")
    first = await stack.append("s1", user("one"), assistant("1"))
    await stack.append("s1", user("two"), assistant("calling", "late"))
    await stack.append("s1", user("three"), assistant("3"))
    await stack.append("s1", user("four"))
    await stack.append("s1", tool("late", "result"))

    response = await stack.build("s1")

    # Only the first turn can be cut safely: the second turn's result lies after the current prompt.
    assert [summarized_ids(call) for call in stack.provider.summarize_calls()] == [first]
    assert response.boundary_message_id == first[-1]


async def test_a_valid_boundary_loads_only_what_follows_it(tmp_path: Path, database_url: str) -> None:
    proxy = RecordingProxy()
    async with running_stack(tmp_path, database_url, proxy=proxy, auto_compaction=False) as stack:
        await stack.new_session("s1")
        ids = await stack.append("s1", user("a"), assistant("b"), user("c"), assistant("d"), user("e"))
        await stack.put_record("s1", ids[1], "earlier")
        proxy.calls.clear()

        response = await stack.build("s1")

        # One incremental read after the boundary; the boundary itself is checked by id, and no read
        # ever starts before it (seed 001 §11.8).
        assert proxy.list_after_bounds() == [ids[1]]
        fetched = [
            tapi.GetMessageRequest.FromString(body).message_id for name, body in proxy.calls if name == "GetMessage"
        ]
        assert fetched == [ids[1]]
        assert [m.message_id for m in response.messages[1:]] == ids[2:]


@pytest.mark.parametrize("existing_record", [False, True], ids=["first_insert", "update"])
async def test_a_compacting_request_reads_the_session_once_and_trusts_the_boundary_it_stored(
    tmp_path: Path, database_url: str, existing_record: bool
) -> None:
    proxy = RecordingProxy()
    async with running_stack(tmp_path, database_url, proxy=proxy) as stack:
        await stack.new_session("s1")
        ids = await stack.append("s1", user("a"), assistant("b"), user("c"), assistant("d"), user("e"))
        if existing_record:
            await stack.put_record("s1", ids[1], "earlier")
        proxy.calls.clear()

        response = await stack.build("s1")

        assert response.compaction.outcome == events_pb2.COMPACTION_OUTCOME_COMPACTED
        assert response.boundary_message_id == ids[3]
        names = [name for name, _ in proxy.calls]
        assert names.count("GetSession") == 1
        # Only a boundary read from the database is checked; the one just stored is fenced already.
        fetched = [
            tapi.GetMessageRequest.FromString(body).message_id for name, body in proxy.calls if name == "GetMessage"
        ]
        assert fetched == ([ids[1]] if existing_record else [])
        start = ids[1] if existing_record else 0
        assert proxy.list_after_bounds() == [start, ids[3]]
        # The request carries the summary just stored, then only what follows it.
        summarized = [i for i in ids[:4] if i > start]
        assert response.messages[0].content[0].text.endswith(f"summary of {summarized}")
        assert [m.message_id for m in response.messages[1:]] == ids[4:]
        assert (await stack.record_rows("s1")) == [(ids[3], f"summary of {summarized}")]


async def test_an_invalid_boundary_costs_exactly_one_full_load(tmp_path: Path, database_url: str) -> None:
    proxy = RecordingProxy()
    async with running_stack(tmp_path, database_url, proxy=proxy, trigger_ratio=1.0) as stack:
        await stack.new_session("s1")
        await stack.append("s1", user("a"), assistant("b"), user("c"))
        await stack.put_record("s1", 10_000_000, "gone")
        proxy.calls.clear()

        await stack.build("s1")

        assert proxy.list_after_bounds() == [0]


async def test_turns_reusing_a_call_id_each_keep_their_tool_result(tmp_path: Path, database_url: str) -> None:
    # Some OpenAI-compatible servers number calls per response, so every turn issues `call_0`.
    async with running_stack(tmp_path, database_url, auto_compaction=False) as stack:
        await stack.new_session("s1")
        ids: list[int] = []
        for number in range(3):
            ids += await stack.append(
                "s1",
                user(f"request {number}"),
                assistant(f"calling {number}", "call_0"),
                tool("call_0", f"output {number}"),
                assistant(f"done {number}"),
            )

        response = await stack.build("s1")

        assert ids_of(response) == ids
        results = [message for message in response.messages if message.role == tpb.MESSAGE_ROLE_TOOL]
        assert [(m.tool_call_id, m.content[0].text) for m in results] == [("call_0", f"output {n}") for n in range(3)]


async def test_tool_rounds_reusing_a_call_id_pair_within_their_turn(tmp_path: Path, database_url: str) -> None:
    async with running_stack(tmp_path, database_url, auto_compaction=False) as stack:
        await stack.new_session("s1")
        prompt = await stack.append("s1", user("two rounds"))
        first = await stack.append("s1", assistant("round 1", "call_0", "call_1"), tool("call_1", "r1b"))
        # The first round's `call_0` result is stored late, next to the second round's, which is stored
        # before the assistant that issued it: each still answers its own round.
        early = await stack.append("s1", tool("call_0", "r1a"), tool("call_0", "r2a"))
        second = await stack.append("s1", assistant("round 2", "call_0"), assistant("finished"))
        later = await stack.append("s1", user("again"), assistant("round 3", "call_0"), tool("call_0", "r3a"))

        response = await stack.build("s1")

        expected = [*prompt, first[0], early[0], first[1], second[0], early[1], second[1], *later]
        assert ids_of(response) == expected
        texts = [m.content[0].text for m in response.messages if m.role == tpb.MESSAGE_ROLE_TOOL]
        assert texts == ["r1a", "r1b", "r2a", "r3a"]


async def test_the_answer_stays_bounded_leaving_out_the_oldest_turns_and_clipping_huge_messages(
    tmp_path: Path, database_url: str
) -> None:
    limit = 1024 * 1024
    async with running_stack(
        tmp_path, database_url, auto_compaction=False, context_max_bytes=limit, context_message_max_bytes=512 * 1024
    ) as stack:
        await stack.new_session("s1")
        for turn in range(6):
            await stack.append(
                "s1", user(f"turn {turn}"), assistant("reading", f"c{turn}"), tool(f"c{turn}", "r" * 300_000)
            )
        huge = (await stack.append("s1", user("x" * 3_000_000)))[0]

        response = await stack.build("s1")

        ids = [m.message_id for m in response.messages]
        assert ids[-1] == huge, "the current turn always stays"
        assert sum(m.ByteSize() for m in response.messages) <= limit
        manifest = response.manifest
        assert manifest.omitted_message_count > 0 and manifest.clipped_message_count == 1
        assert manifest.omitted_message_count + len(ids) == 6 * 3 + 1
        # The oldest whole turns went first: what is kept starts at a USER message.
        assert response.messages[0].role == tpb.MESSAGE_ROLE_USER
        current = response.messages[-1].content[0].text
        assert current.startswith("x" * 1000) and f"of message {huge} left out of this request" in current
        # Only the request was clipped: the transcript keeps the message whole.
        stored = await stack.transcript.stub.GetMessage(
            tapi.GetMessageRequest(session_id="s1", message_id=huge), metadata=stack.user()
        )
        assert stored.message.content[0].text == "x" * 3_000_000
