"""Structured JSON logs. Callers log ids, counts, codes and reasons, never bodies or credentials."""

from __future__ import annotations

import json
import logging
import sys
import traceback
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

_RESERVED = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}
# Causes followed from a logged exception (`raise ... from ...` and exceptions raised while handling one).
MAX_CAUSES = 5
# Frames kept per exception, the innermost (where it was raised): a deep recursion must not make a
# log line of megabytes.
MAX_FRAMES = 64


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, event and the record's `extra` fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "event": record.getMessage(),
        }
        entry.update({k: v for k, v in record.__dict__.items() if k not in _RESERVED})
        if record.exc_info and record.exc_info[0] is not None:
            entry.update(_exception(record.exc_info[0], record.exc_info[1], record.exc_info[2]))
        return json.dumps(entry, default=str)


def described(error: BaseException) -> dict[str, Any]:
    """What a log line says of `error` (its type and frames, and its causes'), for an error met in
    another process and logged here: never its message."""
    return _exception(type(error), error, error.__traceback__)


def _exception(kind: type[BaseException], error: BaseException | None, trace: TracebackType | None) -> dict[str, Any]:
    """The exception's type and frames, then its causes' (innermost last).

    Never the message: messages of driver errors can quote row contents. Never locals or source
    lines either: file, line and function pin the code down in the deployed version, and nothing
    a caller sent can reach the log through them.
    """
    described = {"exception": kind.__name__, **_frames(trace)}
    causes: list[dict[str, Any]] = []
    seen = {id(error)}
    cause = _cause_of(error)
    while cause is not None and id(cause) not in seen and len(causes) < MAX_CAUSES:
        seen.add(id(cause))
        causes.append({"exception": type(cause).__name__, **_frames(cause.__traceback__)})
        cause = _cause_of(cause)
    if causes:
        described["causes"] = causes
    return described


def _cause_of(error: BaseException | None) -> BaseException | None:
    if error is None:
        return None
    if error.__cause__ is not None or error.__suppress_context__:
        return error.__cause__
    return error.__context__


def _frames(trace: TracebackType | None) -> dict[str, Any]:
    """`frames`, outermost first as Python prints a traceback, and how many outer ones were left out."""
    frames = [
        {"file": frame.f_code.co_filename, "line": line, "function": frame.f_code.co_qualname}
        for frame, line in traceback.walk_tb(trace)
    ]
    if len(frames) <= MAX_FRAMES:
        return {"frames": frames}
    return {"frames": frames[-MAX_FRAMES:], "frames_omitted": len(frames) - MAX_FRAMES}


def configure_logging(level: str, service: str) -> None:
    """Send JSON lines to stderr for the whole process."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("continuum").info("logging configured", extra={"service": service})
