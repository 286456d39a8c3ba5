"""A process's peak resident memory, read from Linux's /proc: what tests and benchmarks hold services to."""

from __future__ import annotations

from pathlib import Path


def peak_rss_bytes(pid: int) -> int:
    """The peak resident set size of `pid` since it started or since `reset_peak_rss` (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for process {pid}")


def reset_peak_rss(pid: int) -> None:
    """Start measuring `peak_rss_bytes` of `pid` afresh, e.g. after loading data (writing 5 to clear_refs)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
