"""Must-survive facts: what a summary may not lose, found by the program rather than trusted to the model.

Before a summary is accepted, the summarized messages are scanned for user constraints and decisions,
file paths, commands run, error strings and open todos. Each fact is checked against the summary; the
missing ones get one corrective retry, and whatever is still missing is appended by the program.
Pure functions, no I/O; the facts are message text, so they are never logged.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from continuum_compaction.history import LoadedMessage, message_text

# Facts kept per compaction; the most recent win (a long history has thousands of paths).
MAX_FACTS = 40
MAX_FACT_CHARS = 240

_PATH = re.compile(
    r"(?<![\w/.-])(?:\.{0,2}/)?(?:[\w.-]+/)+[\w.-]+\.[A-Za-z0-9]{1,8}\b|\b[\w-]+\.(?:py|ts|tsx|js|go|rs|java|kt|rb|md|json|ya?ml|toml|sql|sh|proto|c|h|cpp|cs|txt|ini|cfg)\b"
)
_ERROR = re.compile(r"\b(?:error|exception|traceback|failed|fatal|panic)\b|错误|失败", re.IGNORECASE)
_CONSTRAINT = re.compile(
    r"\b(?:must|never|always|do not|don't|should not|shouldn't|only|required?|decided?|prefer|instead of)\b"
    r"|必须|不要|禁止|一定|决定|只能|不能",
    re.IGNORECASE,
)
_TODO = re.compile(r"\bTODO\b|- \[ \]|待办", re.IGNORECASE)
_COMMAND_KEYS = ("command", "cmd", "script")
_WORD = re.compile(r"[\w\u4e00-\u9fff]{3,}")


@dataclass(frozen=True)
class Fact:
    """One thing the summary must keep."""

    kind: str  # constraint | path | command | error | todo
    text: str

    def render(self) -> str:
        """The line appended to a summary that lost this fact."""
        return f"- {self.kind}: {self.text}"


def extract_facts(messages: Sequence[LoadedMessage]) -> list[Fact]:
    """Facts of the summarized messages, deduplicated, at most `MAX_FACTS` (newest kept)."""
    found: dict[tuple[str, str], Fact] = {}
    for loaded in messages:
        for fact in _facts_of(loaded):
            found.pop((fact.kind, fact.text), None)
            found[(fact.kind, fact.text)] = fact
    return list(found.values())[-MAX_FACTS:]


def _facts_of(loaded: LoadedMessage) -> Iterable[Fact]:
    text = message_text(loaded.message)
    if loaded.role == "user":
        for line in _lines(text):
            if _CONSTRAINT.search(line):
                yield Fact("constraint", _clip(line))
            if _TODO.search(line):
                yield Fact("todo", _clip(line))
    for call in loaded.message.tool_calls:
        command = _command_of(call.arguments)
        if command:
            yield Fact("command", _clip(command))
    for line in _lines(text):
        if loaded.role == "tool" and _ERROR.search(line):
            yield Fact("error", _clip(line))
        elif loaded.role == "assistant" and _TODO.search(line):
            yield Fact("todo", _clip(line))
    for path in _PATH.findall(text):
        yield Fact("path", path)


def _command_of(arguments: str) -> str:
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return ""
    if not isinstance(parsed, dict):
        return ""
    for key in _COMMAND_KEYS:
        value = parsed.get(key)
        if isinstance(value, str) and value.strip():
            return value.strip()
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            return " ".join(value)
    return ""


def _lines(text: str) -> Iterable[str]:
    for line in text.splitlines():
        stripped = line.strip()
        if stripped:
            yield stripped


def _clip(text: str) -> str:
    return text if len(text) <= MAX_FACT_CHARS else text[: MAX_FACT_CHARS - 1] + "…"


def is_kept(fact: Fact, summary: str) -> bool:
    """Whether the summary keeps the fact: literally for paths, commands, errors and todos; for a
    constraint (which a model rewords) when most of its significant words are present."""
    folded = summary.casefold()
    if fact.kind != "constraint":
        return fact.text.casefold() in folded
    words = {word.casefold() for word in _WORD.findall(fact.text)}
    if not words:
        return fact.text.casefold() in folded
    present = sum(1 for word in words if word in folded)
    return present / len(words) >= 0.6


def missing_facts(facts: Sequence[Fact], summary: str) -> list[Fact]:
    """The facts the summary lost, in their original order."""
    return [fact for fact in facts if not is_kept(fact, summary)]


PRESERVED_TITLE = "Preserved facts (kept verbatim by Continuum):"
_KINDS = ("constraint", "path", "command", "error", "todo")


def with_preserved_facts(summary: str, missing: Sequence[Fact]) -> str:
    """The summary with the facts it still lost appended by the program, verbatim."""
    if not missing:
        return summary
    lines = "\n".join(fact.render() for fact in missing)
    return f"{summary.rstrip()}\n\n{PRESERVED_TITLE}\n{lines}"


def preserved_facts(summary: str) -> list[Fact]:
    """The facts an earlier summary had to have appended: they must survive the next one too."""
    found: list[Fact] = []
    in_list = False
    for line in summary.splitlines():
        if line == PRESERVED_TITLE:
            in_list = True
            continue
        kind, separator, text = line.removeprefix("- ").partition(": ")
        if in_list and line.startswith("- ") and separator and kind in _KINDS:
            found.append(Fact(kind, text))
        else:
            in_list = False
    return found


def merge_facts(earlier: Iterable[Fact], later: Iterable[Fact]) -> list[Fact]:
    """Both lists without repeats, at most `MAX_FACTS` (the most recent win)."""
    merged: dict[tuple[str, str], Fact] = {}
    for fact in (*earlier, *later):
        merged.pop((fact.kind, fact.text), None)
        merged[(fact.kind, fact.text)] = fact
    return list(merged.values())[-MAX_FACTS:]
