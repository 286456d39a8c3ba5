"""Handoff-read settings, read once at start from `HANDOFF_READ_*` environment variables."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from continuum_runtime.settings import ServiceSettings


class HandoffReadSettings(ServiceSettings):
    """Where merge's packages are, who to ask about runs and bindings, and the limits of one call.

    Handoff-read owns no tables: `database_url` and `migrate_on_start` of the base are unused.
    """

    model_config = SettingsConfigDict(
        env_prefix="HANDOFF_READ_",
        env_nested_delimiter="__",
        frozen=True,
        extra="ignore",
        hide_input_in_errors=True,
    )

    # host:port of the transcript gRPC service (run id -> root session; the target still exists).
    transcript_address: str = "127.0.0.1:50151"
    # host:port of the merge gRPC service (the binding of a merge target).
    merge_address: str = "127.0.0.1:50153"
    # Deadline of one call to transcript or merge.
    call_timeout_seconds: float = Field(default=10.0, gt=0)

    # Merge's package root, mounted read-only (`<package_root>/<operation id>/`): the same path as
    # merge's MERGE_PACKAGE_ROOT. Empty: `<data_dir>/merge-packages`, merge's embedded default.
    package_root: Path | None = None
    # A file holding the key cursors are authenticated with (a Kubernetes Secret mounted as a file);
    # every replica must read the same key. Empty: HANDOFF_READ_PAGE_TOKEN_SECRET, else a random key
    # per process (cursors then do not survive a restart; a warning says so).
    cursor_secret_file: Path | None = None

    # One deadline shared by verification, directory and body reads of a call.
    call_deadline_seconds: float = Field(default=15.0, gt=0, le=300)
    # ready.json is small; a larger one is damage, not a handoff.
    ready_max_bytes: int = Field(default=1024 * 1024, ge=4096)
    # What the reference entry reads of overview.json and brief.json at most (each).
    reference_file_max_bytes: int = Field(default=4 * 1024 * 1024, ge=4096)
    # Scanner processes a search page spreads its text parts over (scanners.py); 0: every search scans
    # in its call's thread. Empty: one per CPU, at most 4, none on a single CPU (nothing to overlap with).
    search_scanners: int | None = Field(default=None, ge=0, le=64)

    def resolved_search_scanners(self) -> int:
        """How many scanner processes to start."""
        if self.search_scanners is not None:
            return self.search_scanners
        cpus = os.cpu_count() or 1
        return min(cpus, 4) if cpus > 1 else 0

    def resolved_package_root(self) -> Path:
        """Where operation directories live."""
        return (self.package_root or self.data_dir / "merge-packages").resolve()
