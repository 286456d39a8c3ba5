"""Log lines carry ids, counts and codes: an exception's text (which can quote a row) never appears,
but where it was raised does."""

from __future__ import annotations

import inspect
import json
import logging
import sys
from collections.abc import Callable

from continuum_runtime.logs import MAX_FRAMES, JsonFormatter


def _parse_row(row: str) -> int:
    try:
        return int(row)
    except ValueError as error:
        raise LookupError("PRIVATE second body while handling the first") from error


def _load() -> int:
    return _parse_row("PRIVATE message body that a driver error quoted")


def _line_of(function: Callable[..., object], text: str) -> int:
    """The number of the line of `function` whose source contains `text`."""
    lines, first = inspect.getsourcelines(function)
    return first + next(offset for offset, line in enumerate(lines) if text in line)


def test_an_exception_is_logged_by_type_and_frames_never_its_text() -> None:
    try:
        _load()
    except LookupError:
        record = logging.LogRecord("continuum", logging.ERROR, __file__, 1, "rpc failed", None, sys.exc_info())
    record.method = "/continuum.transcript.v1.TranscriptService/AppendMessages"

    line = JsonFormatter().format(record)

    assert "PRIVATE" not in line
    entry = json.loads(line)
    assert (entry["event"], entry["exception"], entry["method"]) == (
        "rpc failed",
        "LookupError",
        "/continuum.transcript.v1.TranscriptService/AppendMessages",
    )
    test = test_an_exception_is_logged_by_type_and_frames_never_its_text
    assert entry["frames"] == [
        {"file": __file__, "line": _line_of(test, "        _load()"), "function": test.__name__},
        {"file": __file__, "line": _line_of(_load, "return _parse_row"), "function": "_load"},
        {"file": __file__, "line": _line_of(_parse_row, "raise LookupError"), "function": "_parse_row"},
    ]
    # The cause is followed, by type and frames as well.
    (cause,) = entry["causes"]
    assert cause == {
        "exception": "ValueError",
        "frames": [{"file": __file__, "line": _line_of(_parse_row, "return int(row)"), "function": "_parse_row"}],
    }


def test_an_exception_without_a_traceback_has_no_frames() -> None:
    error = ValueError("PRIVATE body")
    record = logging.LogRecord("continuum", logging.ERROR, __file__, 1, "failed", None, (ValueError, error, None))

    line = JsonFormatter().format(record)

    assert "PRIVATE" not in line
    entry = json.loads(line)
    assert (entry["exception"], entry["frames"]) == ("ValueError", [])
    assert "causes" not in entry


def _recurse(depth: int) -> None:
    if depth == 0:
        raise ValueError("PRIVATE body at the bottom")
    _recurse(depth - 1)


def test_a_deep_traceback_keeps_its_innermost_frames() -> None:
    try:
        _recurse(MAX_FRAMES + 10)
    except ValueError:
        record = logging.LogRecord("continuum", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())

    entry = json.loads(JsonFormatter().format(record))

    assert len(entry["frames"]) == MAX_FRAMES
    # The test function and the outer recursion levels are left out; the raising level is kept.
    assert entry["frames_omitted"] == 12
    assert entry["frames"][-1] == {
        "file": __file__,
        "line": _line_of(_recurse, "raise ValueError"),
        "function": "_recurse",
    }
