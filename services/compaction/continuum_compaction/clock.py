"""Wall-clock time in epoch milliseconds, the unit every compaction table stores."""

import time


def now_ms() -> int:
    """Current UTC time in milliseconds."""
    return time.time_ns() // 1_000_000
