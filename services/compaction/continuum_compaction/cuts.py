"""Where compaction may cut: whole USER turns only (seed 001 §7.6-§7.7).

A turn runs from a USER message to the next one. The last turn is the current one and is never a
candidate at request start, even with `recent_turns = 0`: the runtime stores the user's message before
it asks for context, so a trailing assistant reply proves nothing. At a tool-round boundary of a
running turn (mid-loop) its completed tool rounds may be compacted too, but never split from their
results. Everything here is pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from continuum_compaction.history import LoadedHistory, LoadedMessage


@dataclass(frozen=True)
class Unit:
    """Messages that are compacted together or not at all: a whole turn, or the running turn's request
    with its completed tool rounds (`holds_current_request`)."""

    messages: tuple[LoadedMessage, ...]
    holds_current_request: bool = False

    @property
    def ids(self) -> frozenset[int]:
        """The real ids of the unit's messages."""
        return frozenset(message.message_id for message in self.messages)


@dataclass(frozen=True)
class CutPlan:
    """The candidate units, oldest first; everything else stays verbatim."""

    candidates: tuple[Unit, ...]

    @property
    def candidate_messages(self) -> int:
        """How many messages the candidates hold (what the count minimums compare)."""
        return sum(len(unit.messages) for unit in self.candidates)


def split_turns(view: Sequence[LoadedMessage]) -> list[list[LoadedMessage]]:
    """Group the model-ordered view into turns. Messages before the first USER message (the tail of a
    turn compacted mid-loop) form a leading group of their own."""
    turns: list[list[LoadedMessage]] = []
    for message in view:
        if message.role == "user" or not turns:
            turns.append([message])
        else:
            turns[-1].append(message)
    return turns


def newest_turns_within(history: LoadedHistory, max_bytes: int) -> tuple[LoadedHistory, int]:
    """`history` with its oldest whole turns left out until its messages fit in `max_bytes` (the last,
    current turn always stays), and how many messages were left out."""
    sizes = {message.message_id: message.message.ByteSize() for message in history.view}
    if sum(sizes.values()) <= max_bytes:
        return history, 0
    kept: list[list[LoadedMessage]] = []
    total = 0
    for turn in reversed(split_turns(history.view)):
        size = sum(sizes[message.message_id] for message in turn)
        if kept and total + size > max_bytes:
            break
        kept.append(turn)
        total += size
    view = tuple(message for turn in reversed(kept) for message in turn)
    return replace(history, view=view), len(history.view) - len(view)


def completed_rounds(turn: Sequence[LoadedMessage], start: int) -> int:
    """Where the completed tool rounds from `start` end: each an assistant call message followed by a
    result for every call it made. Stops at the first incomplete round."""
    end = index = start
    while index < len(turn):
        message = turn[index]
        if message.role != "assistant":
            break
        calls = set(message.tool_call_ids)
        index += 1
        while index < len(turn) and turn[index].role == "tool" and turn[index].tool_call_id in calls:
            calls.discard(turn[index].tool_call_id)
            index += 1
        if calls:
            break
        end = index
    return end


def plan_cut(history: LoadedHistory, recent_turns: int, mid_loop: bool) -> CutPlan:
    """The units compaction may summarize now.

    At request start the current turn and the `recent_turns` complete turns before it stay verbatim.
    Mid-loop, every complete turn is a candidate, and so are the running turn's completed tool rounds
    except the latest, which the model is about to read, together with its USER request. When an
    earlier mid-loop compaction already summarized that request, the running turn's remaining rounds
    lead the history and are offered the same way.
    """
    turns = split_turns(history.view)
    if not turns or (len(turns) < 2 and not mid_loop):
        return CutPlan(())
    current, complete = turns[-1], turns[:-1]
    if not mid_loop:
        keep = min(recent_turns, len(complete))
        return CutPlan(safe_prefix(history, [Unit(tuple(turn)) for turn in complete[: len(complete) - keep]]))
    units = [Unit(tuple(turn)) for turn in complete]
    start = 1 if current[0].role == "user" else 0
    end = _all_but_latest_round(current, start, completed_rounds(current, start))
    if end > start:
        units.append(Unit(tuple(current[:end]), holds_current_request=start == 1))
    return CutPlan(safe_prefix(history, units))


def safe_prefix(history: LoadedHistory, units: Sequence[Unit]) -> tuple[Unit, ...]:
    """The longest prefix of `units` whose boundary would pass the prefix-integrity check, found before
    any model call so no summary is paid for that could never be persisted. Linear in the history."""
    ordered = sorted(message.message_id for message in history.view)
    covered: set[int] = set()
    lowest_open = highest = best = 0
    for count, unit in enumerate(units, start=1):
        covered |= unit.ids
        highest = max(highest, *unit.ids)
        while lowest_open < len(ordered) and ordered[lowest_open] in covered:
            lowest_open += 1
        if lowest_open == len(ordered) or highest < ordered[lowest_open]:
            best = count
    return tuple(units[:best])


def _all_but_latest_round(turn: Sequence[LoadedMessage], start: int, end: int) -> int:
    # The latest completed round starts at the last assistant call message before `end`.
    for index in range(end - 1, start - 1, -1):
        if turn[index].role == "assistant" and turn[index].tool_call_ids:
            return index
    return start


def batches(units: Sequence[Unit], max_messages: int, max_batches: int) -> list[list[Unit]]:
    """Group units into at most `max_batches` batches under a soft message limit; a unit larger than
    the limit is a batch of its own and is never split."""
    grouped: list[list[Unit]] = []
    size = 0
    for unit in units:
        if grouped and size + len(unit.messages) <= max_messages:
            grouped[-1].append(unit)
            size += len(unit.messages)
            continue
        if len(grouped) == max_batches:
            break
        grouped.append([unit])
        size = len(unit.messages)
    return grouped


def safe_boundary(history: LoadedHistory, summarized: Sequence[Unit]) -> int | None:
    """The largest real id summarized, if it passes the prefix-integrity check: every message of the
    loaded view with `old < id <= new` must be among the summarized ones. None otherwise."""
    covered: set[int] = set()
    for unit in summarized:
        covered |= unit.ids
    if not covered:
        return None
    candidate = max(covered)
    for message in history.view:
        if history.boundary < message.message_id <= candidate and message.message_id not in covered:
            return None
    return candidate


def should_compact(
    *,
    estimated_tokens: int,
    window_tokens: int,
    trigger_ratio: float,
    plan: CutPlan,
    min_compact_messages: int,
    min_new_messages: int,
) -> bool:
    """The automatic trigger (seed 001 §7.8): the context reached window x ratio and there are enough
    candidate messages. Only messages after the boundary are ever loaded, so every candidate is new."""
    if estimated_tokens < window_tokens * trigger_ratio:
        return False
    return plan.candidate_messages >= max(min_compact_messages, min_new_messages)
