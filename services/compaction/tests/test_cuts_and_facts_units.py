"""Pure cutting and fact rules, checked without servers."""

from __future__ import annotations

import json

from continuum.transcript.v1 import resources_pb2 as tpb
from continuum_compaction.cuts import (
    CutPlan,
    Unit,
    batches,
    completed_rounds,
    newest_turns_within,
    plan_cut,
    safe_boundary,
    should_compact,
    split_turns,
)
from continuum_compaction.facts import Fact, extract_facts, is_kept, missing_facts, with_preserved_facts
from continuum_compaction.history import LoadedMessage, clip, load_history

ROLES = {"u": tpb.MESSAGE_ROLE_USER, "a": tpb.MESSAGE_ROLE_ASSISTANT, "t": tpb.MESSAGE_ROLE_TOOL}


def message(message_id: int, role: str, text: str = "x", calls: tuple[str, ...] = (), answers: str = "") -> tpb.Message:
    """A persisted message of session s1."""
    return tpb.Message(
        message_id=message_id,
        session_id="s1",
        role=ROLES[role],
        content=[tpb.ContentPart(text=text)],
        tool_calls=[tpb.ToolCall(tool_call_id=c, name="shell", arguments="{}") for c in calls],
        tool_call_id=answers,
    )


def ids(units: list[Unit] | tuple[Unit, ...]) -> list[list[int]]:
    return [sorted(unit.ids) for unit in units]


def test_turns_start_at_user_messages_and_a_leading_tail_is_its_own_group() -> None:
    history = load_history(
        10, [message(11, "t", answers="old"), message(12, "a"), message(13, "u"), message(14, "a"), message(15, "u")]
    )
    # The orphan result of a call before the boundary is dropped from the view, and may be passed over.
    assert history.dropped_ids == frozenset({11})
    assert [[m.message_id for m in turn] for turn in split_turns(history.view)] == [[12], [13, 14], [15]]


def test_request_start_never_offers_the_current_turn_even_with_zero_recent_turns() -> None:
    history = load_history(0, [message(1, "u"), message(2, "a"), message(3, "u"), message(4, "a")])
    assert ids(plan_cut(history, recent_turns=0, mid_loop=False).candidates) == [[1, 2]]
    assert plan_cut(history, recent_turns=1, mid_loop=False).candidates == ()
    assert plan_cut(load_history(0, [message(1, "u")]), 0, mid_loop=False).candidates == ()
    assert plan_cut(load_history(0, []), 0, mid_loop=True).candidates == ()


def test_mid_loop_offers_completed_rounds_but_the_latest_and_never_splits_a_round() -> None:
    turn = [
        message(1, "u"),
        message(2, "a", calls=("c1", "c2")),
        message(3, "t", answers="c1"),
        message(4, "t", answers="c2"),
        message(5, "a", calls=("c3",)),
        message(6, "t", answers="c3"),
        message(7, "a", calls=("c4",)),
    ]
    history = load_history(0, turn)
    assert completed_rounds(history.view, 1) == 6
    (unit,) = plan_cut(history, recent_turns=2, mid_loop=True).candidates
    assert sorted(unit.ids) == [1, 2, 3, 4] and unit.holds_current_request
    # One completed round only: it is the latest, so nothing of the running turn is offered.
    assert plan_cut(load_history(0, turn[:4]), recent_turns=0, mid_loop=True).candidates == ()


def test_a_second_mid_loop_compaction_offers_the_rounds_left_after_the_first() -> None:
    # The running turn's request was summarized by an earlier mid-loop compaction: its remaining
    # rounds lead the history, and all but the latest completed one are offered again.
    history = load_history(
        4,
        [
            message(5, "a", calls=("c3",)),
            message(6, "t", answers="c3"),
            message(7, "a", calls=("c4",)),
            message(8, "t", answers="c4"),
            message(9, "a", calls=("c5",)),
            message(10, "t", answers="c5"),
        ],
    )
    (unit,) = plan_cut(history, recent_turns=2, mid_loop=True).candidates
    assert sorted(unit.ids) == [5, 6, 7, 8] and not unit.holds_current_request
    assert plan_cut(history, recent_turns=0, mid_loop=False).candidates == ()


def test_only_tool_calls_start_rounds() -> None:
    # A text-only assistant message is a complete step but starts no round: the latest round is the
    # last tool call's, and the text after it stays with it, verbatim.
    turn = [
        message(1, "u"),
        message(2, "a"),
        message(3, "a", calls=("c1",)),
        message(4, "t", answers="c1"),
        message(5, "a"),
    ]
    history = load_history(0, turn)
    assert completed_rounds(history.view, 1) == 5
    (unit,) = plan_cut(history, recent_turns=0, mid_loop=True).candidates
    assert sorted(unit.ids) == [1, 2] and unit.holds_current_request


def test_the_trigger_holds_exactly_at_the_threshold_and_the_minimum() -> None:
    plan = CutPlan((Unit(tuple(LoadedMessage.of(message(n, "u" if n == 1 else "a")) for n in (1, 2, 3))),))

    def due(tokens: int, minimum: int) -> bool:
        return should_compact(
            estimated_tokens=tokens,
            window_tokens=1000,
            trigger_ratio=0.5,
            plan=plan,
            min_compact_messages=minimum,
            min_new_messages=1,
        )

    assert due(500, 3) and not due(499, 3)
    assert not due(500, 4)


def test_batches_respect_the_soft_limit_and_the_round_cap() -> None:
    def unit(size: int, start: int) -> Unit:
        return Unit(tuple(LoadedMessage.of(message(start + n, "u" if n == 0 else "a")) for n in range(size)))

    units = [unit(2, 0), unit(2, 10), unit(5, 20), unit(1, 30), unit(1, 40)]
    grouped = batches(units, max_messages=4, max_batches=3)
    assert [[len(u.messages) for u in batch] for batch in grouped] == [[2, 2], [5], [1, 1]]
    assert len(batches(units, max_messages=4, max_batches=1)) == 1


def test_prefix_integrity_refuses_a_boundary_past_an_unsummarized_message() -> None:
    history = load_history(
        0,
        [
            message(1, "u"),
            message(2, "a", calls=("late",)),
            message(3, "u"),
            message(4, "a"),
            message(5, "t", answers="late"),
        ],
    )
    first, second = split_turns(history.view)
    assert safe_boundary(history, [Unit(tuple(first))]) is None
    assert safe_boundary(history, [Unit(tuple(first)), Unit(tuple(second))]) == 5
    assert safe_boundary(history, []) is None


def test_facts_are_found_checked_and_appended() -> None:
    shell = tpb.ToolCall(tool_call_id="c", name="shell", arguments=json.dumps({"command": ["make", "test"]}))
    messages = [
        LoadedMessage.of(message(1, "u", "Please update api/server.go. You must keep the old flag.\n- [ ] docs")),
        LoadedMessage.of(tpb.Message(message_id=2, role=tpb.MESSAGE_ROLE_ASSISTANT, tool_calls=[shell])),
        LoadedMessage.of(message(3, "t", "ok\npanic: nil map assignment", answers="c")),
    ]
    facts = extract_facts(messages)
    kinds = {(fact.kind, fact.text) for fact in facts}
    assert ("path", "api/server.go") in kinds
    assert ("command", "make test") in kinds
    assert ("error", "panic: nil map assignment") in kinds
    assert ("todo", "- [ ] docs") in kinds
    assert any(kind == "constraint" and "must keep the old flag" in text for kind, text in kinds)
    summary = "Updated api/server.go; the old flag must be kept. Ran make test."
    missing = missing_facts(facts, summary)
    assert {fact.kind for fact in missing} == {"error", "todo"}
    appended = with_preserved_facts(summary, missing)
    assert appended.startswith(summary) and "- error: panic: nil map assignment" in appended
    assert missing_facts(facts, appended) == []
    assert with_preserved_facts(summary, []) == summary
    assert is_kept(Fact("constraint", "never push to main"), "The user said: never push directly to main.")


def test_a_message_is_clipped_to_the_limit_with_a_note_naming_it() -> None:
    big = message(7, "t", "é" * 3000 + "tail", answers="c")
    big.metadata.update({"k": "v"})

    clipped = clip(big, 1000)

    text = clipped.content[0].text
    kept, note = text.split("\n[", 1)
    assert len(kept.encode()) <= 1000 and big.content[0].text.startswith(kept)
    assert note.startswith(f"{len(big.content[0].text.encode()) - len(kept.encode())} more bytes of message 7")
    assert clipped.metadata == big.metadata and clipped.tool_call_id == "c"
    assert big.content[0].text.endswith("tail"), "the original is not changed"
    small = message(8, "u", "short")
    assert clip(small, 1000) is small


def test_tool_call_arguments_are_clipped_after_the_text() -> None:
    call = tpb.ToolCall(tool_call_id="c", name="write", arguments="x" * 5000)
    original = tpb.Message(message_id=9, role=tpb.MESSAGE_ROLE_ASSISTANT, content=[tpb.ContentPart(text="ok")])
    original.tool_calls.append(call)

    clipped = clip(original, 1000)

    assert clipped.tool_calls[0].arguments == "x" * 998
    assert clipped.content[-1].text.startswith("ok\n[4002 more bytes of message 9")


def test_only_the_newest_whole_turns_that_fit_are_kept_and_the_current_turn_always() -> None:
    turns = [message(n, "u" if n % 3 == 1 else "a", "x" * 100) for n in range(1, 10)]  # turns [1-3] [4-6] [7-9]
    history = load_history(0, turns)
    size = sum(m.message.ByteSize() for m in history.view[-3:])

    kept, omitted = newest_turns_within(history, size + 10)
    assert ([m.message_id for m in kept.view], omitted) == ([7, 8, 9], 6)
    kept, omitted = newest_turns_within(history, 2 * size + 10)
    assert ([m.message_id for m in kept.view], omitted) == ([4, 5, 6, 7, 8, 9], 3)
    kept, omitted = newest_turns_within(history, 10)
    assert ([m.message_id for m in kept.view], omitted) == ([7, 8, 9], 6), "the current turn stays"
    assert newest_turns_within(history, 10**6) == (history, 0)
