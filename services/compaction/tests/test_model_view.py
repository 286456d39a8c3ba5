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


def test_results_pair_within_their_turn_or_with_an_earlier_one() -> None:
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
    # 10 was stored after the next prompt and answers the earlier turn; 7 precedes the only turn
    # that calls "late", and a result never answers a later turn.
    assert ids(view.messages) == [1, 2, 4, 5, 3, 6, 8, 10, 9, 11, 12]
    assert view.report.orphan_ids == (7,)
    assert view.report.duplicate_ids == ()
    assert view.report.moved == 2


def test_call_without_result_is_left_alone() -> None:
    messages = [assistant(1, "a", "b"), tool(2, "b"), user(3)]
    view = build_model_view(messages)
    assert ids(view.messages) == [1, 2, 3]
    assert not view.report.changed


def test_turns_reusing_a_call_id_each_keep_their_result() -> None:
    # Servers that number the calls of every response from call_0 issue the same id in every turn.
    messages: list[Msg] = []
    for turn in range(3):
        first = 4 * turn + 1
        messages += [user(first), assistant(first + 1, "call_0"), tool(first + 2, "call_0"), assistant(first + 3)]
    view = build_model_view(messages)
    assert view.messages == messages
    assert not view.report.changed


def test_tool_rounds_reusing_a_call_id_each_keep_their_result() -> None:
    messages = [
        user(1),
        tool(2, "call_0"),  # stored before its assistant
        assistant(3, "call_0", "call_1"),
        tool(4, "call_1"),
        tool(5, "call_0"),  # the next round's, stored before its assistant too
        assistant(6, "call_0"),
        assistant(7, "call_0"),
        tool(8, "call_0"),
        assistant(9),
    ]
    view = build_model_view(messages)
    assert ids(view.messages) == [1, 3, 2, 4, 6, 5, 7, 8, 9]
    assert view.report.dropped == 0
    assert view.report.moved == 3


def test_a_result_answers_the_nearest_preceding_open_call() -> None:
    messages = [user(1), assistant(2, "c"), assistant(3, "c"), tool(4, "c"), tool(5, "c"), tool(6, "c")]
    view = build_model_view(messages)
    assert ids(view.messages) == [1, 2, 5, 3, 4]
    assert view.report.duplicate_ids == (6,)


def test_calls_of_one_assistant_sharing_an_id_are_answered_in_call_order() -> None:
    messages = [user(1), tool(2, "c"), assistant(3, "c", "d", "c"), tool(4, "d"), tool(5, "c"), tool(6, "c")]
    view = build_model_view(messages)
    assert ids(view.messages) == [1, 3, 2, 4, 5]
    assert view.report.duplicate_ids == (6,)


def test_an_early_result_answers_its_own_turn_before_an_open_call_of_an_earlier_turn() -> None:
    # Turn 1's call was never answered (interrupted); turn 2's result was stored before its assistant.
    messages = [user(1), assistant(2, "call_0"), user(3), tool(4, "call_0"), assistant(5, "call_0")]
    assert ids(model_view(messages)) == [1, 2, 3, 5, 4]


def test_a_result_stored_after_the_next_prompt_answers_the_earlier_turn() -> None:
    messages = [
        user(1),
        assistant(2, "call_0"),
        user(3),
        assistant(4, "call_0"),
        tool(5, "call_0"),
        tool(6, "call_0"),  # turn 1's result, stored late: turn 2's call already has its answer
    ]
    view = build_model_view(messages)
    assert ids(view.messages) == [1, 2, 6, 3, 4, 5]
    assert view.report.dropped == 0


def test_a_late_result_answers_the_nearest_earlier_turn_with_an_open_call() -> None:
    messages = [user(1), assistant(2, "call_0"), user(3), assistant(4, "call_0"), user(5), tool(6, "call_0")]
    assert ids(model_view(messages)) == [1, 2, 3, 4, 6, 5]


def test_a_call_id_issued_again_in_a_later_turn_is_answered_there() -> None:
    messages = [assistant(1, "a"), user(2), assistant(3, "a"), tool(4, "a")]
    view = build_model_view(messages)
    assert ids(view.messages) == [1, 2, 3, 4]
    assert not view.report.changed


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

# Where a call lives: its assistant's id and its position in that assistant's tool_call_ids.
Slot = tuple[int, int]

# How a conversation's call ids are made: unique, numbered per turn, numbered per response (as some
# OpenAI-compatible servers do, so every tool round reuses call_0), or all the same (repeated even
# inside one message).
ID_SCHEMES = ("unique", "per_turn", "per_round", "constant")


@dataclass(frozen=True, eq=False)
class _Draft:
    """A message before it has an id: `key` is where it lands in persistence order."""

    role: Role
    key: float
    tool_call_ids: tuple[str, ...] = ()
    tool_call_id: str = ""


@st.composite
def conversations(draw: st.DrawFn) -> list[Msg]:
    """Persisted conversations with call ids reused across turns and rounds, tool results persisted
    early or late (even past later prompts), orphans, duplicate results, and sometimes a missing
    prefix (loaded after a compaction boundary)."""
    scheme = draw(st.sampled_from(ID_SCHEMES))
    numbers = itertools.count()
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
        if scheme == "per_turn":
            numbers = itertools.count()
        for _ in range(draw(st.integers(1, 3))):
            if scheme == "per_round":
                numbers = itertools.count()
            count = draw(st.integers(0, 3))
            calls = tuple("call_0" if scheme == "constant" else f"call_{next(numbers)}" for _ in range(count))
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


@st.composite
def runtime_conversations(draw: st.DrawFn) -> tuple[list[Msg], list[Msg]]:
    """What a runtime stores when nothing goes wrong, with call ids unique, per turn or per response:
    every call is answered once in its turn, and a tool round's results are stored in any order, some
    before their assistant, but after the previous round's. Returns the stored messages, shuffled,
    and the view that puts every result after the call it was made for."""
    scheme = draw(st.sampled_from(ID_SCHEMES[:3]))
    next_id = itertools.count(draw(st.integers(1, 10_000)))
    numbers = itertools.count()
    stored: list[Msg] = []
    expected: list[Msg] = []
    for _ in range(draw(st.integers(1, 4))):
        prompt = user(next(next_id))
        stored.append(prompt)
        expected.append(prompt)
        if scheme == "per_turn":
            numbers = itertools.count()
        for _ in range(draw(st.integers(0, 3))):
            if scheme == "per_round":
                numbers = itertools.count()
            calls = tuple(f"call_{next(numbers)}" for _ in range(draw(st.integers(1, 3))))
            order = draw(st.permutations(range(len(calls))))
            early = draw(st.integers(0, len(calls)))
            before = [tool(next(next_id), calls[i]) for i in order[:early]]
            call = assistant(next(next_id), *calls)
            after = [tool(next(next_id), calls[i]) for i in order[early:]]
            stored += [*before, call, *after]
            result_of = dict(zip(order, [*before, *after], strict=True))
            expected += [call, *(result_of[i] for i in range(len(calls)))]
        if draw(st.booleans()):
            answer = assistant(next(next_id))
            stored.append(answer)
            expected.append(answer)
    return draw(st.permutations(stored)), expected


def _turn_of(messages: Sequence[Msg]) -> dict[int, int]:
    """Message id -> its turn: 0 before the first USER message, one more from each USER message on."""
    turn = 0
    found: dict[int, int] = {}
    for m in sorted(messages, key=lambda m: m.message_id):
        turn += m.role == Role.USER
        found[m.message_id] = turn
    return found


@dataclass(frozen=True)
class _Expected:
    """What the module docstring's rule gives, worked out naively."""

    answers: dict[int, Slot]  # result id -> the call it answers
    orphan_ids: list[int]
    duplicate_ids: list[int]


def _expected(messages: Sequence[Msg]) -> _Expected:
    """The rule of `continuum_compaction.model_view`'s docstring, transcribed as literally as possible:
    quadratic, and sharing nothing with the implementation."""
    turn_of = _turn_of(messages)
    ordered = sorted(messages, key=lambda m: m.message_id)
    calls = [
        (m.message_id, position, call)
        for m in ordered
        if m.role == Role.ASSISTANT
        for position, call in enumerate(m.tool_call_ids)
        if call
    ]
    answers: dict[int, Slot] = {}
    orphans: list[int] = []
    duplicates: list[int] = []
    for result in (m for m in ordered if m.role == Role.TOOL):
        turn = turn_of[result.message_id]
        unanswered = [(a, p) for a, p, c in calls if c == result.tool_call_id and (a, p) not in answers.values()]
        in_turn = [slot for slot in unanswered if turn_of[slot[0]] == turn]
        preceding = [slot for slot in in_turn if slot[0] < result.message_id]
        in_earlier_turns = [slot for slot in unanswered if turn_of[slot[0]] < turn]
        if preceding:
            answers[result.message_id] = min(preceding, key=lambda slot: (-slot[0], slot[1]))
        elif in_turn:
            answers[result.message_id] = min(in_turn)
        elif in_earlier_turns:
            answers[result.message_id] = min(in_earlier_turns, key=lambda slot: (-slot[0], slot[1]))
        elif any(c == result.tool_call_id and turn_of[a] <= turn for a, _, c in calls):
            duplicates.append(result.message_id)
        else:
            orphans.append(result.message_id)
    return _Expected(answers, orphans, duplicates)


def _expected_view(messages: Sequence[Msg]) -> list[Msg]:
    by_id = {m.message_id: m for m in messages}
    groups: dict[int, list[tuple[int, Msg]]] = {}
    for result_id, (assistant_id, position) in _expected(messages).answers.items():
        groups.setdefault(assistant_id, []).append((position, by_id[result_id]))
    view: list[Msg] = []
    for m in sorted(messages, key=lambda m: m.message_id):
        if m.role != Role.TOOL:
            view.append(m)
            view.extend(result for _, result in sorted(groups.get(m.message_id, []), key=lambda entry: entry[0]))
    return view


def _groups(view: Sequence[Msg]) -> list[tuple[Msg, list[Msg]]]:
    """Each non-tool message of the view with the tool results right after it."""
    groups: list[tuple[Msg, list[Msg]]] = []
    for m in view:
        if m.role == Role.TOOL:
            assert groups, "a view starts with a tool result"
            groups[-1][1].append(m)
        else:
            groups.append((m, []))
    return groups


def _open_calls(view: Sequence[Msg]) -> Counter[tuple[int, str]]:
    """(assistant id, call id) -> how many of its calls with that id the view leaves without a result."""
    left: Counter[tuple[int, str]] = Counter()
    for owner, results in _groups(view):
        left.update((owner.message_id, call) for call in owner.tool_call_ids if call)
        left.subtract((owner.message_id, result.tool_call_id) for result in results)
    return +left


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
def test_results_follow_an_assistant_of_their_turn_or_an_earlier_one_in_call_order(messages: list[Msg]) -> None:
    turn_of = _turn_of(messages)
    for owner, results in _groups(model_view(messages)):
        if results:
            assert owner.role == Role.ASSISTANT
        last = -1
        for result in results:
            assert turn_of[owner.message_id] <= turn_of[result.message_id]
            # Each result takes one of the owner's calls of its id, in call order.
            later = [p for p, call in enumerate(owner.tool_call_ids) if call == result.tool_call_id and p > last]
            assert later, f"{owner} has no call left for {result}"
            last = later[0]


@PROPERTY
@given(conversations())
def test_results_answer_their_own_turn_first_and_are_dropped_only_when_no_call_is_left(
    messages: list[Msg],
) -> None:
    turn_of = _turn_of(messages)
    view = build_model_view(messages)
    still_open = _open_calls(view.messages)

    def open_in(turns: range, call: str, before: float = float("inf")) -> bool:
        return any(c == call and turn_of[a] in turns and a < before for a, c in still_open)

    for owner, results in _groups(view.messages):
        for result in results:
            turn = turn_of[result.message_id]
            own_turn = range(turn, turn + 1)
            if turn_of[owner.message_id] < turn:
                assert not open_in(own_turn, result.tool_call_id)
            if owner.message_id > result.message_id:
                assert not open_in(own_turn, result.tool_call_id, before=result.message_id)
    kept = {m.message_id for m in view.messages}
    for result in messages:
        if result.role == Role.TOOL and result.message_id not in kept:
            assert not open_in(range(turn_of[result.message_id] + 1), result.tool_call_id)
            issued = any(
                result.tool_call_id in m.tool_call_ids and turn_of[m.message_id] <= turn_of[result.message_id]
                for m in messages
                if m.role == Role.ASSISTANT
            )
            assert (result.message_id in view.report.duplicate_ids) == issued
            assert (result.message_id in view.report.orphan_ids) != issued


@PROPERTY
@given(conversations())
def test_the_view_is_the_documented_rule(messages: list[Msg]) -> None:
    view = build_model_view(messages)
    expected = _expected(messages)
    assert view.messages == _expected_view(messages)
    assert list(view.report.orphan_ids) == expected.orphan_ids
    assert list(view.report.duplicate_ids) == expected.duplicate_ids


@PROPERTY
@given(runtime_conversations())
def test_every_result_a_runtime_stores_finds_the_call_it_was_made_for(
    conversation: tuple[list[Msg], list[Msg]],
) -> None:
    stored, expected = conversation
    view = build_model_view(stored)
    assert view.messages == expected
    assert view.report.dropped == 0


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
    expected = _expected(messages)
    dropped = {*expected.orphan_ids, *expected.duplicate_ids}
    assert report.dropped == len(messages) - len(view.messages) == len(dropped)
    assert {m.message_id for m in messages} - {m.message_id for m in view.messages} == dropped

    # Moved: kept results whose predecessor differs from the one they would have in plain id order.
    id_order = sorted(view.messages, key=lambda m: m.message_id)
    before_in_id_order = {b: a for a, b in itertools.pairwise([None, *id_order])}
    before_in_view = {b: a for a, b in itertools.pairwise([None, *view.messages])}
    moved = [m for m in view.messages if m.role == Role.TOOL and before_in_view[m] is not before_in_id_order[m]]
    assert report.moved == len(moved)
    assert (report.moved == 0) == (view.messages == id_order)
    assert report.changed == (report.dropped > 0 or view.messages != id_order)
