"""Compaction settings, read once at start from `COMPACTION_*` environment variables."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from continuum_runtime.provider import ProviderSettings
from continuum_runtime.settings import ServiceSettings


class CompactionSettings(ServiceSettings):
    """Thresholds follow seed 001 §7.7-§7.8; the model's own window always wins over the default."""

    model_config = SettingsConfigDict(
        env_prefix="COMPACTION_",
        env_nested_delimiter="__",
        frozen=True,
        extra="ignore",
        hide_input_in_errors=True,
    )

    # host:port of the transcript gRPC service; it accepts the same service token.
    transcript_address: str = "127.0.0.1:50151"
    # Deadline of one call to transcript.
    transcript_timeout_seconds: float = Field(default=30.0, gt=0)

    # Automatic compaction; off still injects an existing summary, and manual compaction still runs.
    auto_compaction: bool = True
    # Used when a request names no window of its own.
    context_window_tokens: int = Field(default=128_000, ge=1024)
    # Compact once (summary + messages after the boundary) reach this share of the window.
    trigger_ratio: float = Field(default=0.8, gt=0, le=1)
    # Candidate messages (in whole turns) needed before compacting, and how many of them must be new.
    min_compact_message_count: int = Field(default=6, ge=1)
    min_new_message_count: int = Field(default=4, ge=1)
    # Complete turns kept verbatim before the current one.
    recent_turns: int = Field(default=2, ge=0)
    # Soft message limit of one summarization batch (a single larger turn is its own batch).
    max_batch_messages: int = Field(default=40, ge=1)
    # Batches one request may run.
    max_rounds_per_request: int = Field(default=3, ge=1)
    # Each message is clipped to this many characters in a summarization prompt (a 5 MB tool output
    # would otherwise make every batch too large for the summarizing model).
    summary_input_message_chars: int = Field(default=4000, ge=200)
    # Output budget of one summary.
    summary_max_output_tokens: int = Field(default=2048, ge=64)

    # Lease of the claim an idle manual compaction holds (renewed while the model works).
    claim_ttl_seconds: float = Field(default=120.0, ge=5, le=3600)
    # The serialized context manifest stays within this many bytes (memory ids are trimmed first).
    manifest_max_bytes: int = Field(default=8192, ge=1024)
    # Consume transcript's session events to drop records of deleted sessions.
    consume_session_events: bool = True
    # Pause before re-watching transcript's events after the stream broke.
    events_retry_seconds: float = Field(default=2.0, gt=0)

    # COMPACTION_PROVIDER__KIND=openai, COMPACTION_PROVIDER__BASE_URL=..., etc.; offline by default.
    provider: ProviderSettings = ProviderSettings()
