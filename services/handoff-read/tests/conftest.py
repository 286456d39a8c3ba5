"""Handoff-read tests read real merge packages and talk to real transcript and merge servers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from continuum_handoff_read.scanners import Scanners


@pytest.fixture(scope="session")
def scanner_processes() -> Iterator[Scanners]:
    """Two real scanner processes, started once for the session (as the service starts them once)."""
    scanners = Scanners(2)
    try:
        yield scanners
    finally:
        scanners.close()
