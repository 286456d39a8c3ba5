"""The "model view" of a persisted conversation: the message order chat-completion APIs accept.

Messages are persisted with monotonically increasing ids, but concurrent writers sometimes persist a
tool result before the assistant message that issued its call. Model APIs reject a tool message that
does not follow the assistant turn that issued its call, a tool message whose call is absent, and a
second answer to the same call. `build_model_view` repairs those three cases and nothing else: it
never edits, invents or drops a non-tool message, and never mutates its input.

Call ids are not unique. Some OpenAI-compatible servers number the calls of every response from
`call_0`, so one id is issued again in every turn and every tool round, and nothing in the contract
forbids it. A *call* is therefore one entry of an assistant message's `tool_call_ids`, not an id;
an id names several calls, and the empty id names none. Which result answers which call follows
from the order of ids alone, by this rule:

Messages are read in ascending id order. A *turn* starts at each USER message and runs to the next;
the messages before the first USER message form a turn of their own (after a compaction boundary,
the rest of a turn compacted mid-loop). A result answers at most one call and a call has at most one
answer. Each result, in id order, answers the first of these that exists:

1. the nearest preceding unanswered call of its id in its turn: of the latest assistant message
   stored before the result that still has one, the first such call in its `tool_call_ids` order;
2. the first unanswered call of its id in its turn, by assistant id and then call order. All the
   turn's calls of that id stored before the result are answered, so this one follows the result:
   the result was stored before its assistant (a parallel tool round). A result that precedes
   every call of its id in the turn thus answers the turn's first unanswered one;
3. the nearest unanswered call of its id in an earlier turn, latest assistant first and then call
   order: the result was stored after a later prompt. Results never answer calls of a later turn.

A result none of these gives is dropped: an *orphan* when no call of its id was issued in its turn or
an earlier one (also a result whose assistant lies before a loading boundary, which is expected), a
*duplicate* otherwise (results with smaller ids answered every such call). So a dropped result leaves
no call it could answer unanswered, and a result's call depends only on the messages with smaller ids
and the calls of its own turn. Each kept result is placed right after the assistant message of its
call, the results of one assistant in its call order.

Everything here is pure and deterministic: no I/O, no logging. The report carries ids and counts only,
so callers can log it without leaking message bodies.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, Protocol, TypeVar

__all__ = [
    "HistoryMessage",
    "ModelView",
    "ModelViewReport",
    "Role",
    "build_model_view",
    "model_view",
]


class Role(StrEnum):
    """Who authored a message, spelled as chat-completion APIs spell it."""

    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"
    SYSTEM = "system"


class HistoryMessage(Protocol):
    """What this module reads from a persisted message; callers keep their own message type."""

    @property
    def message_id(self) -> int:
        """Persistence order: unique and increasing in the order messages were stored."""
        ...

    @property
    def role(self) -> str:
        """One of the `Role` values."""
        ...

    @property
    def tool_call_ids(self) -> Sequence[str]:
        """Ids of the tool calls an assistant message issued, in its order; empty otherwise."""
        ...

    @property
    def tool_call_id(self) -> str:
        """The call a tool message answers; empty for other roles."""
        ...


M = TypeVar("M", bound=HistoryMessage)


@dataclass(frozen=True)
class ModelViewReport:
    """What `build_model_view` changed, as ids and counts only (safe to log)."""

    moved: int
    """Kept tool results whose predecessor in the view differs from their predecessor in id order."""
    orphan_ids: tuple[int, ...]
    """Ids, ascending, of dropped tool results whose call id no call in their turn or an earlier one has."""
    duplicate_ids: tuple[int, ...]
    """Ids, ascending, of dropped tool results whose every possible call was answered by a smaller id."""

    @property
    def dropped(self) -> int:
        """How many input messages the view leaves out."""
        return len(self.orphan_ids) + len(self.duplicate_ids)

    @property
    def changed(self) -> bool:
        """Whether the view differs from the input sorted by id."""
        return self.moved > 0 or self.dropped > 0


@dataclass(frozen=True)
class ModelView(Generic[M]):
    """The messages to send to a model, in order, and a report of how they were repaired."""

    messages: list[M]
    report: ModelViewReport


def build_model_view(messages: Iterable[M]) -> ModelView[M]:
    """Order `messages` the way chat-completion APIs require and report what that changed.

    Non-tool messages are all kept, in ascending id order. Each tool result answers one call, chosen
    by the rule in this module's docstring, and follows the assistant message that issued it, grouped
    right after it in the order of that assistant's ``tool_call_ids``, even when the result was
    persisted first. Results the rule pairs with no call are dropped as orphans or duplicates. Calls
    without a result are left as they are.

    Message ids must be unique. The result depends only on the messages and their ids, not on the
    input order, and normalizing a view again returns it unchanged. Returned messages
    are the input objects themselves; the input is not modified. Runs in O(n log n).

    Raises:
        ValueError: a message's role is not one of `Role`.
    """
    ordered = sorted(messages, key=lambda m: m.message_id)
    roles = [_role_of(message) for message in ordered]

    pairing = _pair(ordered, roles)

    view: list[M] = []
    for index, message in enumerate(ordered):
        if roles[index] is Role.TOOL:
            continue
        view.append(message)
        group = pairing.answers.get(index)
        if group:
            group.sort(key=lambda entry: entry[0])
            view.extend(result for _, result in group)

    report = ModelViewReport(
        moved=_count_moved(view),
        orphan_ids=tuple(pairing.orphan_ids),
        duplicate_ids=tuple(pairing.duplicate_ids),
    )
    return ModelView(messages=view, report=report)


def model_view(messages: Iterable[M]) -> list[M]:
    """The messages of `build_model_view(messages)`, for callers that do not need the report."""
    return build_model_view(messages).messages


@dataclass
class _Pairing(Generic[M]):
    """Which result answers which call, and which results answer none."""

    answers: dict[int, list[tuple[int, M]]] = field(default_factory=dict)
    """Index of an assistant message in id order -> (position in its ``tool_call_ids``, result)."""
    orphan_ids: list[int] = field(default_factory=list)
    duplicate_ids: list[int] = field(default_factory=list)


def _pair(ordered: Sequence[M], roles: Sequence[Role]) -> _Pairing[M]:
    """Apply the rule of the module docstring to the messages in id order (`roles` are theirs)."""
    pairing: _Pairing[M] = _Pairing()
    earlier: dict[str, deque[_Calls]] = {}  # unanswered calls of finished turns, latest assistant last
    issued: set[str] = set()
    for turn in _turns(roles):
        # Calls whose assistant the scan has passed (latest last), and those it has not (earliest first).
        passed: dict[str, deque[_Calls]] = {}
        upcoming: dict[str, deque[_Calls]] = {}
        for index in turn:
            if roles[index] is Role.ASSISTANT:
                for call_id, calls in _calls_by_id(index, ordered[index].tool_call_ids):
                    upcoming.setdefault(call_id, deque()).append(calls)
        issued.update(upcoming)
        for index in turn:
            message = ordered[index]
            if roles[index] is Role.ASSISTANT:
                for call_id in set(message.tool_call_ids) & upcoming.keys():
                    waiting = upcoming[call_id]
                    # Absent when early results already answered all of its calls of this id.
                    if waiting and waiting[0].assistant == index:
                        passed.setdefault(call_id, deque()).append(waiting.popleft())
            elif roles[index] is Role.TOOL:
                call_id = message.tool_call_id
                if not (
                    _answer(passed.get(call_id), message, pairing, latest=True)
                    or _answer(upcoming.get(call_id), message, pairing, latest=False)
                    or _answer(earlier.get(call_id), message, pairing, latest=True)
                ):
                    dropped = pairing.duplicate_ids if call_id in issued else pairing.orphan_ids
                    dropped.append(message.message_id)
        for call_id, unanswered in passed.items():
            earlier.setdefault(call_id, deque()).extend(unanswered)
    return pairing


@dataclass(frozen=True)
class _Calls:
    """The unanswered calls of one id issued by one assistant message: its index in id order and
    their positions in its ``tool_call_ids``, first first."""

    assistant: int
    positions: deque[int]


def _turns(roles: Sequence[Role]) -> Iterator[range]:
    """Index ranges of the turns: one from each USER message, plus the messages before the first."""
    starts = [index for index, role in enumerate(roles) if role is Role.USER]
    if not starts or starts[0] != 0:
        starts.insert(0, 0)
    for start, end in itertools.pairwise([*starts, len(roles)]):
        if start < end:
            yield range(start, end)


def _calls_by_id(assistant: int, call_ids: Sequence[str]) -> Iterator[tuple[str, _Calls]]:
    """The calls of one assistant message (its index is `assistant`), grouped by id."""
    positions: dict[str, deque[int]] = {}
    for position, call_id in enumerate(call_ids):
        if call_id:  # the empty id is never a real call
            positions.setdefault(call_id, deque()).append(position)
    for call_id, found in positions.items():
        yield call_id, _Calls(assistant, found)


def _answer(candidates: deque[_Calls] | None, result: M, pairing: _Pairing[M], *, latest: bool) -> bool:
    """Let `result` answer the first unanswered call of the latest (or earliest) assistant among
    `candidates`, removing that call from them; False when there is none."""
    if not candidates:
        return False
    calls = candidates[-1] if latest else candidates[0]
    pairing.answers.setdefault(calls.assistant, []).append((calls.positions.popleft(), result))
    if not calls.positions:
        if latest:
            candidates.pop()
        else:
            candidates.popleft()
    return True


def _role_of(message: HistoryMessage) -> Role:
    try:
        return Role(message.role)
    except ValueError:
        # The id only: the role column could hold anything, and callers may log this message.
        raise ValueError(f"message {message.message_id} has an unknown role") from None


def _count_moved(view: Sequence[HistoryMessage]) -> int:
    # Comparing predecessors, rather than indices, keeps one late-persisted result from counting
    # every message after it as moved.
    by_id = sorted(m.message_id for m in view)
    previous_by_id: dict[int, int | None] = dict(zip(by_id, [None, *by_id], strict=False))
    moved = 0
    previous: int | None = None
    for message in view:
        if message.role == Role.TOOL and previous_by_id[message.message_id] != previous:
            moved += 1
        previous = message.message_id
    return moved
