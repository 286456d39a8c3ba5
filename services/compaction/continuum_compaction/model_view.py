"""The "model view" of a persisted conversation: the message order chat-completion APIs accept.

Messages are persisted with monotonically increasing ids, but concurrent writers sometimes persist a
tool result before the assistant message that issued its call. Model APIs reject a tool message that
does not follow the assistant turn that issued its call, a tool message whose call is absent, and a
second answer to the same call. `build_model_view` repairs those three cases and nothing else: it
never edits, invents or drops a non-tool message, and never mutates its input.

Callers that load only the messages after a compaction boundary get tool results whose assistant lies
before the boundary; those results are orphans of this view and are dropped, which is expected.

Everything here is pure and deterministic: no I/O, no logging. The report carries ids and counts only,
so callers can log it without leaking message bodies.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
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
    """Ids, ascending, of dropped tool results whose call no assistant message in the input issued."""
    duplicate_ids: tuple[int, ...]
    """Ids, ascending, of dropped tool results answering a call that an earlier (smaller id) result answered."""

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

    Non-tool messages are all kept, in ascending id order. Each tool result follows the assistant
    message that issued its call, grouped right after it in the order of that assistant's
    ``tool_call_ids``, even when the result was persisted first. Tool results are dropped
    when no assistant message in the input issued their call (orphans, including results whose
    assistant lies before a loading boundary) or when a result with a smaller id already answers the
    same call (duplicates). Calls without a result are left as they are.

    Message ids must be unique. The result depends only on the messages and their ids, not on the
    input order, and normalizing a view again returns it unchanged. Returned messages
    are the input objects themselves; the input is not modified. Runs in O(n log n).

    Raises:
        ValueError: a message's role is not one of `Role`.
    """
    ordered = sorted(messages, key=lambda m: m.message_id)

    # Call ids should be unique; if one is issued twice anyway, the first assistant (by id) owns it so
    # that its single kept answer has one deterministic place. The empty id is never a real call.
    call_owner: dict[str, tuple[int, int]] = {}
    for index, message in enumerate(ordered):
        role = _role_of(message)
        if role is Role.ASSISTANT:
            for position, call_id in enumerate(message.tool_call_ids):
                if call_id:
                    call_owner.setdefault(call_id, (index, position))

    results: dict[int, list[tuple[int, int, M]]] = {}
    answered: set[str] = set()
    orphan_ids: list[int] = []
    duplicate_ids: list[int] = []
    for message in ordered:
        if message.role != Role.TOOL:
            continue
        owner = call_owner.get(message.tool_call_id)
        if owner is None:
            orphan_ids.append(message.message_id)
        elif message.tool_call_id in answered:
            duplicate_ids.append(message.message_id)
        else:
            answered.add(message.tool_call_id)
            owner_index, position = owner
            results.setdefault(owner_index, []).append((position, message.message_id, message))

    view: list[M] = []
    for index, message in enumerate(ordered):
        if message.role == Role.TOOL:
            continue
        view.append(message)
        group = results.get(index)
        if group:
            group.sort(key=lambda entry: (entry[0], entry[1]))
            view.extend(result for _, _, result in group)

    report = ModelViewReport(
        moved=_count_moved(view),
        orphan_ids=tuple(orphan_ids),
        duplicate_ids=tuple(duplicate_ids),
    )
    return ModelView(messages=view, report=report)


def model_view(messages: Iterable[M]) -> list[M]:
    """The messages of `build_model_view(messages)`, for callers that do not need the report."""
    return build_model_view(messages).messages


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
