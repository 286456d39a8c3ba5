"""Merge settings, read once at start from `MERGE_*` environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import Self

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from continuum_merge.extraction.budget import ExtractionSettings
from continuum_runtime.provider import ProviderSettings
from continuum_runtime.settings import ServiceSettings


class MergeSettings(ServiceSettings):
    """Admission, claims, the worker's lease and the package tree of the merge service."""

    model_config = SettingsConfigDict(
        env_prefix="MERGE_",
        env_nested_delimiter="__",
        frozen=True,
        extra="ignore",
        hide_input_in_errors=True,
    )

    # host:port of the transcript gRPC service; it accepts the same service token.
    transcript_address: str = "127.0.0.1:50151"
    # Deadline of one call to transcript.
    transcript_timeout_seconds: float = Field(default=30.0, gt=0)

    # Root of the package tree (`<package_root>/<operation id>/`). Empty: `<data_dir>/merge-packages`.
    package_root: Path | None = None
    # Free disk space the snapshot copy and the extraction's writes leave untouched; running short (or a
    # write failing for space or quota) pauses with DISK_RESERVE.
    disk_reserve_bytes: int = Field(default=1024**3, ge=0)

    # Lease of the MERGE claims on the source trees until the snapshot is sealed: a merge process that
    # crashed stops blocking its sources' turns after this long at most.
    claim_ttl_seconds: float = Field(default=60.0, ge=2, le=3600)
    # The claims are renewed this often while held, well inside the lease.
    claim_renew_seconds: float = Field(default=20.0, gt=0)

    # The worker's lease on an operation in the database: another replica takes the operation over
    # once it lapses (a killed worker stops renewing it).
    lease_ttl_seconds: float = Field(default=10.0, ge=1, le=600)
    lease_renew_seconds: float = Field(default=3.0, gt=0)
    # How often an idle worker looks for operations that need one (a start in this process wakes it at once).
    worker_poll_seconds: float = Field(default=2.0, gt=0)
    # Operations one replica works on at once.
    max_concurrent_runs: int = Field(default=4, ge=1, le=64)
    # Unit rows a run reads at once (each row is small and bounded: ids, hashes, a short input description).
    unit_page_size: int = Field(default=256, ge=1, le=4096)
    # A run stopped by a transient failure (transcript or the provider unreachable) retries after this long.
    retry_seconds: float = Field(default=30.0, gt=0)
    # Recovery tests only: the named point (see `worker`) at which the process kills itself.
    crash_at: str = Field(default="", max_length=64)
    # Recovery tests only: the named point (see `worker`) at which a run waits until the process is killed.
    hold_at: str = Field(default="", max_length=64)
    # Run the worker in this process (off: this replica only answers the API).
    worker_enabled: bool = True
    # Names this replica's leases. Empty: a name unique to this start.
    instance_id: str = Field(default="", max_length=200, pattern=r"^[A-Za-z0-9._:-]*$")

    # The model that extracts and aggregates when a request names none; empty: the provider's own.
    default_model: str = Field(default="", max_length=200)

    # Consume transcript's session events (a deleted target's package is removed).
    consume_session_events: bool = True
    # Pause before re-watching transcript's events after the stream broke.
    events_retry_seconds: float = Field(default=2.0, gt=0)
    # How often cancelled operations without a run (cancelled while paused) are cleaned up.
    cancel_sweep_seconds: float = Field(default=30.0, gt=0)

    # MERGE_PROVIDER__KIND=openai, MERGE_PROVIDER__BASE_URL=..., etc.; offline by default.
    provider: ProviderSettings = ProviderSettings()
    # MERGE_EXTRACTION__REQUEST_TOKENS=..., etc.: request budgets, byte guards, per-call timeout, attempts.
    extraction: ExtractionSettings = ExtractionSettings()

    @model_validator(mode="after")
    def _renewals_within_leases(self) -> Self:
        if self.claim_renew_seconds >= self.claim_ttl_seconds:
            raise ValueError("claim_renew_seconds must be shorter than claim_ttl_seconds")
        if self.lease_renew_seconds >= self.lease_ttl_seconds:
            raise ValueError("lease_renew_seconds must be shorter than lease_ttl_seconds")
        return self

    def resolved_package_root(self) -> Path:
        """Where operation directories live."""
        return (self.package_root or self.data_dir / "merge-packages").resolve()
