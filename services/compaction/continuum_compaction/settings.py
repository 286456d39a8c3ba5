"""Compaction settings, read once at start from `COMPACTION_*` environment variables."""

from __future__ import annotations

from typing import Self

from pydantic import Field, model_validator
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

    # host:port of the handoff-read gRPC service, asked only for merged sessions (their reference entry
    # and HandoffRead tool); ordinary sessions never reach it.
    handoff_read_address: str = "127.0.0.1:50155"
    # Deadline of one call to handoff-read (its own deadline for the work is 15 s).
    handoff_read_timeout_seconds: float = Field(default=20.0, gt=0)
    # The reference entry's share of the history budget (window x trigger ratio), and its ceiling.
    handoff_reference_ratio: float = Field(default=0.1, gt=0, le=0.5)
    handoff_reference_max_tokens: int = Field(default=2048, ge=1, le=32 * 1024)

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

    # Nothing BuildContext answers grows with the history: each message's text is clipped to
    # `context_message_max_bytes` (with a note), and when the messages after the boundary would pass
    # `context_max_bytes` together, the oldest whole turns are left out of the request (the manifest
    # counts both; later compactions summarize what was left out).
    context_message_max_bytes: int = Field(default=1024 * 1024, ge=4096)
    context_max_bytes: int = Field(default=32 * 1024 * 1024, ge=1024 * 1024)
    # Lease of the claim an idle manual compaction holds: a compaction that crashed stops blocking its
    # session's turns after this long at most (sooner when it restarts: it releases its claims at start).
    claim_ttl_seconds: float = Field(default=15.0, ge=2, le=3600)
    # The claim is renewed this often while the model works, well inside the lease so that a renewal
    # that is late or lost does not let it lapse.
    claim_renew_seconds: float = Field(default=5.0, gt=0)
    # Names this replica's claims in transcript, so that its next start can release what it held when it
    # crashed. Must be stable across restarts of one replica and never shared by two live ones. Empty:
    # `<host name>@<host>:<port>` (a Kubernetes pod keeps its name across container restarts, and no two
    # live processes bind one address and port); on port 0, a name of this start only (its claims lapse).
    instance_id: str = Field(default="", max_length=200, pattern=r"^[A-Za-z0-9._:-]*$")
    # The serialized context manifest stays within this many bytes (memory ids are trimmed first).
    manifest_max_bytes: int = Field(default=8192, ge=1024)
    # Consume transcript's session events to drop records of deleted sessions.
    consume_session_events: bool = True
    # Pause before re-watching transcript's events after the stream broke.
    events_retry_seconds: float = Field(default=2.0, gt=0)

    # COMPACTION_PROVIDER__KIND=openai, COMPACTION_PROVIDER__BASE_URL=..., etc.; offline by default.
    provider: ProviderSettings = ProviderSettings()

    @model_validator(mode="after")
    def _renewal_within_lease(self) -> Self:
        if self.claim_renew_seconds >= self.claim_ttl_seconds:
            raise ValueError("claim_renew_seconds must be shorter than claim_ttl_seconds")
        return self
