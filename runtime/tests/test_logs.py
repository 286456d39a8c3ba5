"""Log lines carry ids, counts and codes: an exception's text (which can quote a row) never appears."""

from __future__ import annotations

import json
import logging

from continuum_runtime.logs import JsonFormatter


def test_an_exception_is_logged_by_type_only() -> None:
    try:
        raise ValueError("PRIVATE message body that a driver error quoted")
    except ValueError as error:
        record = logging.LogRecord(
            "continuum", logging.ERROR, __file__, 1, "rpc failed", None, (ValueError, error, None)
        )
    record.method = "/continuum.transcript.v1.TranscriptService/AppendMessages"

    line = JsonFormatter().format(record)

    assert "PRIVATE" not in line
    entry = json.loads(line)
    assert (entry["event"], entry["exception"], entry["method"]) == (
        "rpc failed",
        "ValueError",
        "/continuum.transcript.v1.TranscriptService/AppendMessages",
    )
