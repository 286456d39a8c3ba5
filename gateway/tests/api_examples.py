"""The worked examples of docs/api.md, parsed, and how an answer is compared with its example.

An HTTP example is a fenced ``http`` block holding a request as it goes on the wire (request line,
headers, blank line, body), followed by one holding the answer (status line, headers, body). A
WebSocket example is a ``websocket`` block: ``WS <path>``, then ``> <message sent>`` and
``< <message received>`` (a message may go on over the lines that follow it). ``$TOKEN`` stands
for the user's bearer token.

An answer matches its example when it has the same shape: the same keys in every object, the same
number of items in every list, values of the same JSON types. In the example, a ``"...": "..."``
entry lets an object have other keys, and a last ``"..."`` item lets a list have more items.
A body that is not JSON must begin with the example's text before its ``...``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"
ELISION = "..."
_BLOCK = re.compile(r"^```(http|websocket)\n(.*?)^```", re.MULTILINE | re.DOTALL)


@dataclass
class HttpExample:
    """One request and the answer the documentation promises."""

    line: int
    method: str
    target: str
    headers: dict[str, str]
    body: str
    status: int = 0
    response_headers: dict[str, str] = field(default_factory=dict)
    response_body: str = ""

    @property
    def label(self) -> str:
        """How the failure report names the example."""
        return f"docs/api.md:{self.line} {self.method} {self.target}"


@dataclass
class WebSocketExample:
    """A Follow socket: what the client sends and the messages it receives, in order."""

    line: int
    path: str
    sent: list[str]
    received: list[str]

    @property
    def label(self) -> str:
        """How the failure report names the example."""
        return f"docs/api.md:{self.line} WS {self.path}"


Example = HttpExample | WebSocketExample


def examples(text: str) -> list[Example]:
    """The examples of a document, in order; an HTTP request without its answer is an error."""
    found: list[Example] = []
    for match in _BLOCK.finditer(text):
        kind, block = match.groups()
        line = text.count("\n", 0, match.start()) + 1
        if kind == "websocket":
            first, *rest = block.strip().splitlines()
            messages: list[tuple[str, str]] = []
            for item in rest:
                if item[:2] in ("> ", "< "):
                    messages.append((item[0], item[2:]))
                else:  # a message continues over several lines
                    direction, text = messages[-1]
                    messages[-1] = (direction, f"{text}\n{item}")
            sent = [text for direction, text in messages if direction == ">"]
            received = [text for direction, text in messages if direction == "<"]
            found.append(WebSocketExample(line, first.split(" ", 1)[1], sent, received))
            continue
        start, headers, body = _message(block)
        if start.startswith("HTTP/"):
            previous = found[-1] if found else None
            if not isinstance(previous, HttpExample) or previous.status:
                raise ValueError(f"docs/api.md:{line}: an answer without its request")
            previous.status = int(start.split()[1])
            previous.response_headers = headers
            previous.response_body = body
        else:
            method, target = start.split()
            found.append(HttpExample(line, method, target, headers, body))
    unanswered = [e.label for e in found if isinstance(e, HttpExample) and not e.status]
    if unanswered:
        raise ValueError(f"requests without an answer: {unanswered}")
    return found


def _message(block: str) -> tuple[str, dict[str, str], str]:
    head, _, body = block.partition("\n\n")
    start, *lines = head.strip().splitlines()
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip()] = value.strip()
    return start.strip(), headers, body.strip()


def differences(documented: Any, actual: Any, path: str = "$") -> list[str]:
    """Where `actual` does not have the shape of `documented` (empty: it matches)."""
    if isinstance(documented, dict):
        if not isinstance(actual, dict):
            return [f"{path}: expected an object, got {_kind(actual)}"]
        open_ended = documented.get(ELISION) == ELISION
        expected = {k: v for k, v in documented.items() if k != ELISION}
        found = []
        missing = sorted(set(expected) - set(actual))
        extra = sorted(set(actual) - set(expected))
        if missing:
            found.append(f"{path}: missing {missing}")
        if extra and not open_ended:
            found.append(f"{path}: not documented {extra}")
        for key in sorted(set(expected) & set(actual)):
            found += differences(expected[key], actual[key], f"{path}.{key}")
        return found
    if isinstance(documented, list):
        if not isinstance(actual, list):
            return [f"{path}: expected an array, got {_kind(actual)}"]
        open_ended = bool(documented) and documented[-1] == ELISION
        items = documented[:-1] if open_ended else documented
        if len(actual) < len(items) or (len(actual) != len(items) and not open_ended):
            return [f"{path}: expected {len(items)} items, got {len(actual)}"]
        found = []
        for index, item in enumerate(items):
            found += differences(item, actual[index], f"{path}[{index}]")
        return found
    if _kind(documented) != _kind(actual) and documented != ELISION:
        return [f"{path}: expected {_kind(documented)}, got {_kind(actual)}"]
    return []


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if value is None:
        return "null"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def body_differences(documented: str, actual: str) -> list[str]:
    """`differences` of two bodies, or of a text body's beginning."""
    try:
        expected = json.loads(documented) if documented else None
    except ValueError:
        prefix = documented.split(ELISION, 1)[0]
        return [] if actual.startswith(prefix) else [f"does not begin with {prefix!r}"]
    if expected is None:
        return [] if not actual else ["expected no body"]
    return differences(expected, json.loads(actual))


def is_elided(documented: Any) -> bool:
    """Whether an example body leaves anything out (then only its shape can be checked)."""
    if isinstance(documented, dict):
        return documented.get(ELISION) == ELISION or any(is_elided(v) for v in documented.values())
    if isinstance(documented, list):
        return (bool(documented) and documented[-1] == ELISION) or any(is_elided(v) for v in documented)
    return bool(documented == ELISION)
