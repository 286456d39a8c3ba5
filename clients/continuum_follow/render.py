"""A followed session as terminal text: committed messages, streaming text as it arrives, notes.

`Renderer.render` turns each `Update` into the text to append to the terminal (it never writes
anything itself). A terminal can't take text back, so the renderer remembers what it has shown:
streaming text is extended in place, and a baseline shows only what is new unless the history
it already showed was rewritten, in which case it says so and shows the history again.
"""

from __future__ import annotations

from dataclasses import dataclass

from continuum.transcript.v1 import follow_pb2 as fpb
from continuum.transcript.v1 import resources_pb2 as pb
from continuum_follow.client import DISCONNECT, Update
from continuum_follow.store import Prefix, RecordStore, Status

ARGUMENTS_LIMIT = 120
# Messages the renderer remembers having shown (to notice a rewrite of what is on screen).
SHOWN_LIMIT = 1024
RESULT_LIMIT = 160
DIM, RESET = "\x1b[2m", "\x1b[0m"
ROLE_NAMES = {
    pb.MESSAGE_ROLE_USER: "user",
    pb.MESSAGE_ROLE_ASSISTANT: "assistant",
    pb.MESSAGE_ROLE_TOOL: "tool",
    pb.MESSAGE_ROLE_SYSTEM: "system",
}
RUN_STATE_NOTES = {
    fpb.RUN_STATE_IDLE: "idle",
    fpb.RUN_STATE_RUNNING: "running",
    fpb.RUN_STATE_WAITING: "waiting for the user",
}


def abbreviate(text: str, limit: int) -> str:
    """`text` on one line, cut to about `limit` characters with a count of what was left out."""
    flat = " ".join(text.split())
    if len(flat) <= limit:
        return flat
    return f"{flat[: limit - 1]}… (+{len(flat) - limit + 1} chars)"


def message_text(message: pb.Message) -> str:
    """The message's text parts, with attachments as placeholders; for a stub, its preview and size."""
    if message.body_deferred:
        preview = f"{message.preview} " if message.preview else ""
        return f"{preview}[{_size(message.body_bytes)} body not shown: message {message.message_id}]"
    parts = []
    for part in message.content:
        if part.WhichOneof("part") == "text":
            parts.append(part.text)
        elif part.WhichOneof("part") == "attachment":
            parts.append(f"[attachment {part.attachment.media_type or part.attachment.attachment_id}]")
    return "".join(parts)


def _size(count: int) -> str:
    if count < 1024:
        return f"{count} bytes"
    if count < 1024 * 1024:
        return f"{count / 1024:.1f} KiB"
    return f"{count / (1024 * 1024):.1f} MiB"


def message_key(message: pb.Message) -> str:
    """The sampling message key the server records on a committed attempt, or ""."""
    value = message.metadata.fields.get("messageKey")
    return value.string_value if value is not None else ""


@dataclass
class _Streamed:
    attempt: int
    text: str


class Renderer:
    """Turns updates into terminal text; keeps what it showed so it only ever appends."""

    def __init__(self, *, color: bool = False) -> None:
        self._color = color
        # What each shown message looked like, to notice a rewrite of shown history.
        self._shown: dict[int, int] = {}
        self._streamed: dict[str, _Streamed] = {}
        # The message key whose streaming line is open (not yet ended by a newline).
        self._line: str | None = None
        self._run_state: int = fpb.RUN_STATE_UNSPECIFIED
        self._failing = False

    def render(self, update: Update) -> str:
        """The text this update adds to the terminal ("" when nothing visible changed)."""
        out: list[str] = []
        if update.outcome.status is Status.RESYNC:
            if update.kind == DISCONNECT:
                # Never connected: say so, and why (a wrong address, the service down), rather than
                # "lost" a connection there never was.
                lost = "connection lost" if update.store.cursor is not None else "cannot reach the transcript service"
                self._note(
                    out, f"{lost} ({update.cause}); following again" if update.cause else f"{lost}; following again"
                )
            else:
                self._note(out, f"resync ({update.outcome.reason}); following again")
            return "".join(out)
        if update.outcome.status is not Status.APPLIED or update.store.cursor is None:
            return ""
        store = update.store
        if update.kind == "snapshot_end":
            self._baseline(out, store)
        elif update.frame is not None and update.kind == "batch":
            batch = update.frame.batch
            settled = batch.settles.message_key if batch.HasField("settles") else ""
            for message in batch.messages:
                self._committed(out, message, settled)
        self._prefixes(out, store)
        self._status(out, store)
        return "".join(out)

    def finish(self) -> str:
        """The text that leaves the terminal on a fresh line when following ends."""
        out: list[str] = []
        self._close_line(out)
        return "".join(out)

    def _baseline(self, out: list[str], store: RecordStore) -> None:
        messages = store.ordered_messages()
        if self._rewritten(messages):
            self._note(out, "the history was rewritten; showing it again")
            self._shown.clear()
        for message in messages:
            self._committed(out, message, "")

    def _rewritten(self, messages: list[pb.Message]) -> bool:
        # A baseline after an overflow or a restart repeats what was shown; after an edit, shown
        # messages changed or are gone. Messages older than the baseline's page are not checked.
        if not self._shown:
            return False
        if not messages:
            return True
        by_id = {message.message_id: message for message in messages}
        oldest = messages[0].message_id
        for message_id, signature in self._shown.items():
            if message_id < oldest:
                continue
            message = by_id.get(message_id)
            if message is None or _signature(message) != signature:
                return True
        return False

    def _committed(self, out: list[str], message: pb.Message, settled_key: str) -> None:
        if message.message_id in self._shown:
            return
        key = message_key(message) or settled_key
        streamed = self._streamed.pop(key, None) if message.role == pb.MESSAGE_ROLE_ASSISTANT else None
        text = message_text(message)
        self._shown[message.message_id] = _signature(message)
        if len(self._shown) > SHOWN_LIMIT:
            # Only recent messages can be repeated by a baseline; older ones need not be remembered.
            del self._shown[min(self._shown)]
        if streamed is not None and text.startswith(streamed.text):
            # The message completes the line being streamed: add only what was not streamed.
            self._continue_line(out, key, streamed.attempt)
            out.append(text[len(streamed.text) :])
            self._line = None
            out.append(_interrupted(message) + "\n")
            out.extend(_tool_calls(message))
            return
        self._close_line(out)
        if message.role == pb.MESSAGE_ROLE_TOOL:
            out.append(f"  ← {abbreviate(text, RESULT_LIMIT)}\n")
            return
        out.append(f"{ROLE_NAMES.get(message.role, 'message')}: {text}{_interrupted(message)}\n")
        out.extend(_tool_calls(message))

    def _prefixes(self, out: list[str], store: RecordStore) -> None:
        for key, prefix in store.prefixes.items():
            shown = self._streamed.get(key)
            if shown is None or shown.attempt != prefix.attempt or not prefix.text.startswith(shown.text):
                self._open_line(out, key, prefix)
            elif len(prefix.text) > len(shown.text):
                self._continue_line(out, key, prefix.attempt)
                out.append(prefix.text[len(shown.text) :])
                shown.text = prefix.text
        for key in [key for key in self._streamed if key not in store.prefixes]:
            # Ended without a message we could match (e.g. settled while we were away).
            del self._streamed[key]
            if self._line == key:
                self._close_line(out)

    def _open_line(self, out: list[str], key: str, prefix: Prefix) -> None:
        self._close_line(out)
        out.append(f"{_assistant_header(prefix.attempt)}{prefix.text}")
        self._line = key
        self._streamed[key] = _Streamed(prefix.attempt, prefix.text)

    def _continue_line(self, out: list[str], key: str, attempt: int) -> None:
        # Another line (or a note) came in between: mark the continuation instead of repeating text.
        if self._line != key:
            self._close_line(out)
            out.append(f"{_assistant_header(attempt)}… ")
            self._line = key

    def _status(self, out: list[str], store: RecordStore) -> None:
        state = store.runtime_state.state
        if state != self._run_state and state in RUN_STATE_NOTES:
            self._note(out, RUN_STATE_NOTES[state])
        self._run_state = state
        failure = store.recovery_failure
        if failure is not None and not self._failing:
            self._note(out, f"saving failed ({failure.reason}); output kept, the server keeps retrying")
        elif failure is None and self._failing:
            self._note(out, "saving works again")
        self._failing = failure is not None

    def _note(self, out: list[str], text: str) -> None:
        self._close_line(out)
        out.append(f"{DIM}· {text}{RESET}\n" if self._color else f"· {text}\n")

    def _close_line(self, out: list[str]) -> None:
        if self._line is not None:
            out.append("\n")
            self._line = None


def _assistant_header(attempt: int) -> str:
    return f"assistant [retry {attempt - 1}]: " if attempt > 1 else "assistant: "


def _interrupted(message: pb.Message) -> str:
    return " [interrupted]" if message.status == pb.MESSAGE_STATUS_INTERRUPTED else ""


def _tool_calls(message: pb.Message) -> list[str]:
    return [f"  → tool {call.name}({abbreviate(call.arguments, ARGUMENTS_LIMIT)})\n" for call in message.tool_calls]


def _signature(message: pb.Message) -> int:
    return hash(
        (message.role, message.status, message_text(message), tuple(c.tool_call_id for c in message.tool_calls))
    )
