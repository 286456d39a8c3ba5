"""Tests for the model view of a persisted conversation (`continuum_compaction.model_view`)."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from continuum_compaction.model_view import ModelViewReport, Role, build_model_view, model_view

# No example database: these tests must not leave files in the working tree.
PROPERTY = settings(database=None, max_examples=200, deadline=None)


# eq=False: identity comparison, so the tests can tell callers get their own objects back.
@dataclass(frozen=True, eq=False)
class Msg:
    message_id: int
    role: str
    tool_call_ids: tuple[str, ...] = ()
    tool_call_id: str = ""

    def __repr__(self) -> str:
        detail = self.tool_call_id or ",".join(self.tool_call_ids)
        return f"{self.role}#{self.message_id}({detail})"


def user(message_id: int) -> Msg:
    return Msg(message_id, Role.USER)


def system(message_id: int) -> Msg:
    return Msg(message_id, Role.SYSTEM)


def assistant(message_id: int, *calls: str) -> Msg:
    return Msg(message_id, Role.ASSISTANT, tool_call_ids=calls)


def tool(message_id: int, call: str) -> Msg:
    return Msg(message_id, Role.TOOL, tool_call_id=call)


def ids(messages: Sequence[Msg]) -> list[int]:
    return [m.message_id for m in messages]


# --- examples ---------------------------------------------------------------------------------------


def test_empty_input_gives_empty_view() -> None:
    empty: list[Msg] = []
    view = build_model_view(empty)
    assert view.messages == []
    assert view.report == ModelViewReport(moved=0, orphan_ids=(), duplicate_ids=())


def test_already_ordered_input_is_unchanged() -> None:
    messages = [
        system(1),
        user(2),
        assistant(3, "a", "b"),
        tool(4, "a"),
        tool(5, "b"),
        assistant(6),
        user(7),
        assistant(8, "c"),
        tool(9, "c"),
        assistant(10),
    ]
    view = build_model_view(messages)
    assert view.messages == messages
    assert view.report == ModelViewReport(moved=0, orphan_ids=(), duplicate_ids=())
    assert not view.report.changed


def test_tool_persisted_before_its_assistant_is_moved_after_it() -> None:
    messages = [user(1), tool(2, "a"), assistant(3, "a"), assistant(4)]
    view = build_model_view(messages)
    assert ids(view.messages) == [1, 3, 2, 4]
    assert view.report.moved == 1
    assert view.report.dropped == 0
    assert view.report.changed


def test_results_follow_the_order_of_the_assistant_tool_calls() -> None:
    messages = [assistant(1, "a", "b", "c"), tool(2, "c"), tool(3, "a"), tool(4, "b"), assistant(5)]
    view = build_model_view(messages)
    assert ids(view.messages) == [1, 3, 4, 2, 5]
    assert view.report.dropped == 0


def test_results_persisted_on_both_sides_of_their_assistant_are_grouped() -> None:
    messages = [tool(1, "b"), assistant(2, "a", "b"), user(3), tool(4, "a")]
    assert ids(model_view(messages)) == [2, 4, 1, 3]


def test_orphan_result_is_dropped() -> None:
    messages = [user(1), tool(2, "gone"), assistant(3, "a"), tool(4, "a")]
    view = build_model_view(messages)
    assert ids(view.messages) == [1, 3, 4]
    assert view.report.orphan_ids == (2,)
    assert view.report.duplicate_ids == ()


def test_results_of_an_assistant_before_the_boundary_are_orphans() -> None:
    # Loaded after a compaction boundary: the assistant that issued "old" was not loaded.
    messages = [tool(11, "old"), tool(12, "old2"), user(13), assistant(14, "new"), tool(15, "new")]
    view = build_model_view(messages)
    assert ids(view.messages) == [13, 14, 15]
    assert view.report.orphan_ids == (11, 12)


def test_empty_call_id_never_matches() -> None:
    messages = [assistant(1, ""), tool(2, "")]
    view = build_model_view(messages)
    assert ids(view.messages) == [1]
    assert view.report.orphan_ids == (2,)


def test_duplicate_result_is_dropped_keeping_the_first_by_id() -> None:
    messages = [assistant(1, "a"), tool(2, "a"), tool(3, "a"), user(4)]
    view = build_model_view(messages)
    assert ids(view.messages) == [1, 2, 4]
    assert view.report.duplicate_ids == (3,)
    assert view.report.orphan_ids == ()


def test_duplicate_persisted_before_the_assistant_is_the_one_kept() -> None:
    messages = [tool(1, "a"), assistant(2, "a"), tool(3, "a")]
    view = build_model_view(messages)
    assert ids(view.messages) == [2, 1]
    assert view.report.duplicate_ids == (3,)
    assert view.report.moved == 1


def test_user_turns_in_between() -> None:
    messages = [
        system(1),
        user(2),
        tool(3, "a2"),
        assistant(4, "a1", "a2"),
        tool(5, "a1"),
        user(6),
        tool(7, "late"),
        assistant(8, "b1"),
        user(9),
        tool(10, "b1"),
        user(11),
        assistant(12, "late"),
    ]
    view = build_model_view(messages)
    assert ids(view.messages) == [1, 2, 4, 5, 3, 6, 8, 10, 9, 11, 12, 7]
    assert view.report.dropped == 0
    assert view.report.moved == 3


def test_call_without_result_is_left_alone() -> None:
    messages = [assistant(1, "a", "b"), tool(2, "b"), user(3)]
    view = build_model_view(messages)
    assert ids(view.messages) == [1, 2, 3]
    assert not view.report.changed


def test_call_id_issued_twice_belongs_to_the_first_assistant() -> None:
    messages = [assistant(1, "a"), user(2), assistant(3, "a"), tool(4, "a")]
    assert ids(model_view(messages)) == [1, 4, 2, 3]


def test_input_order_does_not_matter_and_input_is_not_mutated() -> None:
    messages = [tool(3, "a"), user(1), assistant(2, "a"), tool(4, "x")]
    before = list(messages)
    view = build_model_view(iter(messages))
    assert ids(view.messages) == [1, 2, 3]
    assert view.report.orphan_ids == (4,)
    assert messages == before
    assert view.messages is not messages


def test_unknown_role_is_rejected_without_quoting_it() -> None:
    with pytest.raises(ValueError, match=r"^message 7 has an unknown role$"):
        build_model_view([user(1), Msg(7, "secret-ish")])


# --- properties -------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class _Draft:
    """A message before it has an id: `key` is where it lands in persistence order."""

    role: Role
    key: float
    tool_call_ids: tuple[str, ...] = ()
    tool_call_id: str = ""


@st.composite
def conversations(draw: st.DrawFn) -> list[Msg]:
    """Realistic persisted conversations, with tool results persisted early or late, orphans,
    duplicate results, and sometimes a missing prefix (loaded after a compaction boundary)."""
    fresh_call = (f"call_{n}" for n in itertools.count())
    drafts: list[_Draft] = []
    position = 0

    def add(draft_role: Role, calls: tuple[str, ...] = (), answers: str = "", key: float | None = None) -> None:
        nonlocal position
        drafts.append(_Draft(draft_role, float(position) if key is None else key, calls, answers))
        position += 1

    if draw(st.booleans()):
        add(Role.SYSTEM)
    for _ in range(draw(st.integers(0, 4))):
        add(Role.USER)
        for _ in range(draw(st.integers(1, 3))):
            calls = tuple(next(fresh_call) for _ in range(draw(st.integers(0, 3))))
            issued_at = position
            add(Role.ASSISTANT, calls)
            # Results complete in any order, and some calls never get one.
            answered = draw(st.permutations(calls))[: draw(st.integers(0, len(calls)))]
            for call in answered:
                # Concurrent writers: a result may be persisted before its assistant, or after later turns.
                # Positions are whole numbers, so a key ending in .5 lands between two messages.
                shift = draw(st.sampled_from([0, 0, -1, -2, 1, 3]))
                if shift < 0:
                    add(Role.TOOL, answers=call, key=issued_at + shift + 0.5)
                else:
                    add(Role.TOOL, answers=call, key=position + shift + 0.5 if shift else None)
                if draw(st.integers(0, 9)) == 0:
                    add(Role.TOOL, answers=call, key=draw(st.floats(-1, position + 1)))

    for n in range(draw(st.integers(0, 2))):
        add(Role.TOOL, answers=f"orphan_{n}", key=draw(st.floats(-1, position + 1)))

    persisted = sorted(drafts, key=lambda d: d.key)  # stable: equal keys keep their drafting order
    persisted = persisted[draw(st.integers(0, 3)) :]

    next_id = draw(st.integers(1, 10_000))
    messages: list[Msg] = []
    for d in persisted:
        messages.append(Msg(next_id, d.role, d.tool_call_ids, d.tool_call_id))
        next_id += draw(st.integers(1, 3))
    return messages


def _issuers(messages: Sequence[Msg]) -> dict[str, Msg]:
    """Each issued call id -> the first assistant (by id) that issued it."""
    issuer: dict[str, Msg] = {}
    for m in sorted(messages, key=lambda m: m.message_id):
        if m.role == Role.ASSISTANT:
            for call in m.tool_call_ids:
                issuer.setdefault(call, m)
    return issuer


def _expected_drops(messages: Sequence[Msg]) -> tuple[list[int], list[int]]:
    issuer = _issuers(messages)
    tools = sorted((m for m in messages if m.role == Role.TOOL), key=lambda m: m.message_id)
    orphans = [m.message_id for m in tools if m.tool_call_id not in issuer]
    seen: set[str] = set()
    duplicates: list[int] = []
    for m in tools:
        if m.tool_call_id in issuer:
            if m.tool_call_id in seen:
                duplicates.append(m.message_id)
            seen.add(m.tool_call_id)
    return orphans, duplicates


@PROPERTY
@given(conversations())
def test_output_is_a_sub_multiset_keeping_every_non_tool_message_once(messages: list[Msg]) -> None:
    before = list(messages)
    out = model_view(messages)
    assert messages == before
    assert not Counter(out) - Counter(messages)
    non_tool_in = [m for m in messages if m.role != Role.TOOL]
    assert Counter(m for m in out if m.role != Role.TOOL) == Counter(non_tool_in)


@PROPERTY
@given(conversations())
def test_non_tool_messages_keep_ascending_id_order(messages: list[Msg]) -> None:
    out_ids = [m.message_id for m in model_view(messages) if m.role != Role.TOOL]
    assert out_ids == sorted(m.message_id for m in messages if m.role != Role.TOOL)


@PROPERTY
@given(conversations())
def test_every_result_sits_in_its_assistant_group_in_call_order(messages: list[Msg]) -> None:
    issuer = _issuers(messages)
    out = model_view(messages)
    group_owner: Msg | None = None
    last_position = -1
    for m in out:
        if m.role != Role.TOOL:
            group_owner, last_position = m, -1
            continue
        # No orphan, and the nearest non-tool message before it is the assistant that issued it.
        assert m.tool_call_id in issuer
        assert group_owner is issuer[m.tool_call_id]
        position = group_owner.tool_call_ids.index(m.tool_call_id)
        assert position > last_position
        last_position = position


@PROPERTY
@given(conversations())
def test_each_answered_call_keeps_exactly_its_first_result(messages: list[Msg]) -> None:
    issuer = _issuers(messages)
    first_answer: dict[str, int] = {}
    for m in messages:
        if m.role == Role.TOOL and m.tool_call_id in issuer:
            first_answer[m.tool_call_id] = min(m.message_id, first_answer.get(m.tool_call_id, m.message_id))
    kept = {m.tool_call_id: m.message_id for m in model_view(messages) if m.role == Role.TOOL}
    assert kept == first_answer
    assert sum(m.role == Role.TOOL for m in model_view(messages)) == len(kept)


@PROPERTY
@given(conversations())
def test_normalizing_twice_changes_nothing(messages: list[Msg]) -> None:
    first = build_model_view(messages)
    second = build_model_view(first.messages)
    assert second.messages == first.messages
    assert second.report == ModelViewReport(moved=first.report.moved, orphan_ids=(), duplicate_ids=())


@PROPERTY
@given(st.data(), conversations())
def test_input_order_does_not_matter(data: st.DataObject, messages: list[Msg]) -> None:
    shuffled = data.draw(st.permutations(messages))
    assert build_model_view(shuffled) == build_model_view(messages)


@PROPERTY
@given(conversations())
def test_report_counts_match(messages: list[Msg]) -> None:
    view = build_model_view(messages)
    report = view.report
    orphans, duplicates = _expected_drops(messages)
    assert list(report.orphan_ids) == orphans
    assert list(report.duplicate_ids) == duplicates
    assert report.dropped == len(messages) - len(view.messages)
    assert {m.message_id for m in messages} - {m.message_id for m in view.messages} == {*orphans, *duplicates}

    # Moved: kept results whose predecessor differs from the one they would have in plain id order.
    id_order = sorted(view.messages, key=lambda m: m.message_id)
    before_in_id_order = {b: a for a, b in itertools.pairwise([None, *id_order])}
    before_in_view = {b: a for a, b in itertools.pairwise([None, *view.messages])}
    moved = [m for m in view.messages if m.role == Role.TOOL and before_in_view[m] is not before_in_id_order[m]]
    assert report.moved == len(moved)
    assert (report.moved == 0) == (view.messages == id_order)
    assert report.changed == (report.dropped > 0 or view.messages != id_order)
