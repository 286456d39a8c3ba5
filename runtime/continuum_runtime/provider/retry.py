"""When to try a request again: exponential backoff with jitter, or what the server asked for (Retry-After)."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

__all__ = ["backoff_delay", "parse_retry_after"]


def parse_retry_after(value: str | None, *, now: datetime | None = None) -> float | None:
    """Seconds a ``Retry-After`` value asks to wait, given as delta-seconds or an HTTP-date.

    None when the header is absent or unreadable; a date in the past is 0. `now` defaults to the current time.
    """
    if value is None or not value.strip():
        return None
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        # RFC 9110 dates are in GMT; a "-0000" zone parses as naive.
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


def backoff_delay(
    retry: int, *, first_seconds: float, max_seconds: float, jitter: float, retry_after: float | None = None
) -> float:
    """Seconds to wait before retry number `retry` (1 for the first), never more than `max_seconds`.

    The server's `retry_after` wins when it gave one. Otherwise the delay doubles from `first_seconds` and
    `jitter` (uniform in [0, 1)) picks a point in its upper half, so clients that failed together spread out
    instead of retrying in lockstep.
    """
    if retry_after is not None:
        return min(retry_after, max_seconds)
    # The exponent is capped so a large retry count cannot overflow a float.
    ceiling = min(max_seconds, first_seconds * 2.0 ** min(retry - 1, 32))
    return ceiling / 2 + ceiling / 2 * jitter
