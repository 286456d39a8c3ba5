"""The built-in provider: an extractive summarizer that needs no key, no network and no model.

It does not understand the conversation. It copies lines that tend to matter when work resumes
(what the user asked, file paths, commands, errors, constraints and to-dos) and says so in its first
line, so nobody mistakes its output for an LLM's. Same messages in, same summary out.

Structured requests (`structured`) get schema-v2 items instead: one per input in ``extract`` mode,
filed by the request's hints for the kind of line found; one per section and status in ``condense`` mode.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from .base import ChatMessage, Completion, Usage
from .errors import ProviderOutputTruncated
from .structured import HINT_KINDS, StructuredRequest, parse_structured_request
from .tokens import estimate_message_tokens, estimate_tokens, estimate_tokens_of_bytes

__all__ = ["OFFLINE_MODEL", "OfflineProvider"]

OFFLINE_MODEL = "offline-extractive-1"
HEADER = (
    f"Extractive summary by the offline provider ({OFFLINE_MODEL}), not an LLM: "
    "lines copied from the conversation, not rewritten."
)
DEFAULT_MAX_OUTPUT_TOKENS = 1024

_MAX_LINE_CHARS = 200
# Per section: the first item and the most recent ones, which best say where the work stands.
_MAX_ITEMS_PER_SECTION = 12
_CUT_MARKER = "[more lines omitted to fit the output limit]"

_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s")
# Error words, and exception class names such as AssertionError or KeyError.
_ERROR = re.compile(r"(?i:\b(?:error|exception|traceback|failed|failure|fatal|panic)\b)|[a-z](?:Error|Exception)\b")
_NOTE = re.compile(r"\b(?:todo|fixme|must|never|always|do not|don't|should not|shouldn't|important)\b", re.IGNORECASE)
_INLINE_CODE = re.compile(r"`([^`\n]{1,200})`")
_PATH_CHARS = re.compile(r"[\w.~/+@-]+")
_PATH_PUNCTUATION = "`'\"()[]{}<>,;:!?*"
# Word lists split at run time, so they read as lists rather than as columns of quoted words.
_FILE_EXTENSIONS = frozenset(
    "c cc cfg conf cpp cs css csv env go h hpp html ini ipynb java js json jsonl jsx kt lock log md mjs "  # noqa: SIM905
    "php proto py pyi rb rs rst scss sh sql swift toml ts tsx txt xml yaml yml zsh".split()
)
_FILE_NAMES = frozenset({"Makefile", "Dockerfile", "Justfile"})
# Programs whose name starting a line means a command, not an English sentence.
_PROGRAMS = frozenset(
    "alembic apt-get bash cargo cd continuum curl docker git grep kubectl ls mkdir mypy node npm npx pip "  # noqa: SIM905
    "pip3 pnpm poetry psql pytest python python3 rg rm ruff sed sh ssh sudo tar uv uvicorn wget yarn".split()
)
# Also English words: a command only after a shell prompt ("$ ") or in backticks.
_AMBIGUOUS_PROGRAMS = frozenset({"make", "go", "cat", "export"})


class OfflineProvider:
    """A deterministic extractive summarizer behind the `ModelProvider` interface; the embedded default.

    Usage is reported as estimates (`tokens.estimate_tokens`): there is no tokenizer to count with.
    """

    name = "offline"

    def __init__(self, *, max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS) -> None:
        self._max_output_tokens = max_output_tokens

    @property
    def model(self) -> str:
        """Always `OFFLINE_MODEL`."""
        return OFFLINE_MODEL

    async def aclose(self) -> None:
        """Nothing to release."""

    async def complete(self, messages: Sequence[ChatMessage], *, max_output_tokens: int | None = None) -> Completion:
        """An extractive summary of `messages`, cut at a line boundary to fit the output limit.

        System messages are skipped: they carry the instructions, not the conversation. Raises
        `ProviderOutputTruncated` only when the limit is too small for even the first line.
        A structured request gets its items as JSON instead, the last items left out to fit the limit;
        `ProviderOutputTruncated` when not even one fits. A malformed structured request is a ValueError.
        """
        if max_output_tokens is not None and max_output_tokens < 1:
            raise ValueError("max_output_tokens must be at least 1")
        limit = min(self._max_output_tokens, max_output_tokens or self._max_output_tokens)
        request = parse_structured_request(messages)
        if request is not None:
            text = _fit_items(_structured_items(request), limit)
        else:
            text = _fit([HEADER, *_summary_lines(messages)], limit)
        usage = Usage(
            prompt_tokens=sum(estimate_message_tokens(m.role, m.content) for m in messages),
            completion_tokens=estimate_tokens(text),
        )
        return Completion(text=text, model=OFFLINE_MODEL, usage=usage, finish_reason="stop")


def _summary_lines(messages: Sequence[ChatMessage]) -> list[str]:
    # Dicts, not sets: they drop repeats and keep first-seen order, so the output is deterministic.
    sections: dict[str, dict[str, None]] = {
        "User requests:": {},
        "Files:": {},
        "Commands:": {},
        "Errors:": {},
        "Constraints and to-dos:": {},
    }
    last_reply = ""
    for message in messages:
        if message.content.startswith(HEADER):
            # An earlier summary of ours being folded forward: keep its items, so a summary built
            # over several batches still holds what the first batches found.
            last_reply = _merge_previous(message.content, sections) or last_reply
            continue
        if message.role == "system":
            continue
        lines = [line for line in (_ANSI_ESCAPE.sub("", raw).strip() for raw in message.content.splitlines()) if line]
        if lines and message.role == "user":
            sections["User requests:"][_clip(_SENTENCE_END.split(lines[0], maxsplit=1)[0])] = None
        if lines and message.role == "assistant":
            last_reply = _clip(lines[0])
        for line in lines:
            for path in _paths(line):
                sections["Files:"][path] = None
            for span in _INLINE_CODE.findall(line):
                if _is_command(span, prompt_or_code=True):
                    sections["Commands:"][_clip(span.strip())] = None
            if _is_command(line, prompt_or_code=False):
                sections["Commands:"][_clip(line.removeprefix("$ "))] = None
            elif _ERROR.search(line):
                sections["Errors:"][_clip(line)] = None
            elif _NOTE.search(line):
                sections["Constraints and to-dos:"][_clip(line)] = None
    out: list[str] = []
    for title, items in sections.items():
        if items:
            out.append(title)
            out.extend(f"- {item}" for item in _keep_first_and_recent(list(items)))
    if last_reply:
        out += [_LAST_REPLY_TITLE, f"- {last_reply}"]
    return out or ["(nothing to extract: the conversation has no matching lines)"]


_LAST_REPLY_TITLE = "Last assistant message begins:"


def _merge_previous(summary: str, sections: dict[str, dict[str, None]]) -> str:
    """Add the items of an earlier offline summary to `sections`; returns its last-reply line."""
    current: dict[str, None] | None = None
    last_reply = ""
    in_last_reply = False
    for line in summary.splitlines()[1:]:
        if line in sections:
            current, in_last_reply = sections[line], False
        elif line == _LAST_REPLY_TITLE:
            current, in_last_reply = None, True
        elif line.startswith("- ") and not line.endswith(" more omitted]"):
            if in_last_reply:
                last_reply = line[2:]
            elif current is not None:
                current[line[2:]] = None
    return last_reply


def _keep_first_and_recent(items: list[str]) -> list[str]:
    if len(items) <= _MAX_ITEMS_PER_SECTION:
        return items
    omitted = len(items) - _MAX_ITEMS_PER_SECTION
    return [items[0], f"[{omitted} more omitted]", *items[-(_MAX_ITEMS_PER_SECTION - 1) :]]


def _fit(lines: list[str], max_tokens: int) -> str:
    """`lines` joined, or as many of them as fit `max_tokens` (estimated) followed by a cut marker."""
    text = "\n".join(lines)
    if estimate_tokens(text) <= max_tokens:
        return text
    kept = [lines[0]]
    size = len(lines[0].encode()) + 1 + len(_CUT_MARKER.encode())
    if estimate_tokens_of_bytes(size) > max_tokens:
        raise ProviderOutputTruncated(f"output limit of {max_tokens} tokens is too small for an offline summary")
    for line in lines[1:]:
        grown = size + len(line.encode()) + 1
        if estimate_tokens_of_bytes(grown) > max_tokens:
            break
        kept.append(line)
        size = grown
    if kept[-1].endswith(":") and not kept[-1].startswith("- "):
        kept.pop()  # a section title without any of its items
    return "\n".join([*kept, _CUT_MARKER])


def _paths(line: str) -> Iterator[str]:
    """File paths in `line`: words with a known file extension or rooted at /, ./, ../ or ~/, but no URLs."""
    for word in line.split():
        # "path.py:12:5" (compilers, grep) and "path.py::test" (pytest) name the file before the colon.
        token = word.strip(_PATH_PUNCTUATION).split(":", 1)[0].rstrip(".")
        if len(token) > _MAX_LINE_CHARS or "://" in token or not _PATH_CHARS.fullmatch(token):
            continue
        name = token.rsplit("/", 1)[-1]
        stem, dot, extension = name.rpartition(".")
        is_file = (dot and stem and extension.lower() in _FILE_EXTENSIONS) or name in _FILE_NAMES
        if is_file or (name and token.startswith(("/", "./", "../", "~/"))):
            yield token


def _is_command(text: str, *, prompt_or_code: bool) -> bool:
    """Whether `text` is a shell command: after a "$ " prompt, or starting with a known program's name."""
    if text.startswith("$ "):
        return True
    program = text.split(maxsplit=1)[0].rsplit("/", 1)[-1] if text.strip() else ""
    if prompt_or_code:
        return program in _PROGRAMS or program in _AMBIGUOUS_PROGRAMS
    # A bare line ending like a sentence is prose that happens to start with a program's name.
    return program in _PROGRAMS and not text.endswith((".", "?", "!"))


def _clip(text: str) -> str:
    return _clip_to(text, _MAX_LINE_CHARS)


# Condensed items quote this many of their group's items, each clipped to this many characters.
_CONDENSED_QUOTES = 3
_CONDENSED_QUOTE_CHARS = 80


def _structured_items(request: StructuredRequest) -> list[dict[str, Any]]:
    """The items the offline provider answers `request` with (before fitting the output limit)."""
    if request.mode == "extract":
        return [
            item
            for entry in request.inputs
            if entry.get("context") is not True and (item := _extracted_item(entry, request.hints)) is not None
        ]
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for entry in request.inputs:
        key = (entry.get("section"), entry.get("status"))
        content = entry.get("content")
        if key[0] in request.sections and key[1] in request.statuses and isinstance(content, str) and content:
            groups.setdefault((str(key[0]), str(key[1])), []).append(entry)
    items = []
    for (section, status), entries in groups.items():
        quotes = [_clip_to(str(entry["content"]), _CONDENSED_QUOTE_CHARS) for entry in entries[:_CONDENSED_QUOTES]]
        if len(entries) > _CONDENSED_QUOTES:
            quotes.append(f"+{len(entries) - _CONDENSED_QUOTES} more")
        # A group of one is only clipped: a count in front would make it longer than what it condenses.
        content = quotes[0] if len(entries) == 1 else f"{len(entries)} items: " + " | ".join(quotes)
        items.append(
            {
                "section": section,
                "status": status,
                "content": content,
                "evidence": [str(entry["alias"]) for entry in entries],
            }
        )
    return items


def _extracted_item(entry: Mapping[str, Any], hints: Mapping[str, tuple[str, str]]) -> dict[str, Any] | None:
    """One item for one input: its most telling line, filed by the hint for that line's kind."""
    role, text = str(entry.get("role", "")), entry.get("text")
    if not isinstance(text, str):
        return None
    lines = [line for line in (_ANSI_ESCAPE.sub("", raw).strip() for raw in text.splitlines()) if line]
    if not lines:
        return None
    found: dict[str, str] = {}
    for line in lines:
        if _ERROR.search(line):
            found.setdefault("error", line)
        if _is_command(line, prompt_or_code=False):
            found.setdefault("command", line.removeprefix("$ "))
        if next(_paths(line), None) is not None:
            found.setdefault("file", line)
        if _NOTE.search(line):
            found.setdefault("note", line)
    found.setdefault("request" if role == "user" else "other", lines[0])
    kind = next(kind for kind in HINT_KINDS if kind in found)
    section, status = hints[kind]
    return {
        "section": section,
        "status": status,
        "content": f"{role or 'input'}: {_clip(found[kind])}",
        "evidence": [str(entry["alias"])],
    }


def _fit_items(items: list[dict[str, Any]], max_tokens: int) -> str:
    """``{"schemaVersion": 2, "items": …}`` with as many of `items` as fit `max_tokens` (estimated)."""

    def render(kept: list[dict[str, Any]]) -> str:
        return json.dumps({"schemaVersion": 2, "items": kept}, ensure_ascii=False)

    text = render(items)
    if estimate_tokens(text) <= max_tokens:
        return text
    size = len(render([]).encode())
    for count, item in enumerate(items):
        # Each further item adds its own JSON and a separating ", ".
        size += len(json.dumps(item, ensure_ascii=False).encode()) + (2 if count else 0)
        if estimate_tokens_of_bytes(size) > max_tokens:
            if count == 0:
                break
            return render(items[:count])
    raise ProviderOutputTruncated(f"output limit of {max_tokens} tokens is too small for one structured item")


def _clip_to(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: chars - 1] + "…"
