"""Transcript settings, read once at start from `TRANSCRIPT_*` environment variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from continuum_runtime.settings import ServiceSettings


class TranscriptSettings(ServiceSettings):
    """Limits have sane defaults: a 5 MB tool output is ordinary, not an error."""

    model_config = SettingsConfigDict(env_prefix="TRANSCRIPT_", frozen=True, extra="ignore", hide_input_in_errors=True)

    max_message_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    max_batch_messages: int = Field(default=1000, ge=1)
    max_batch_bytes: int = Field(default=48 * 1024 * 1024, ge=1024)
    max_attachment_bytes: int = Field(default=100 * 1024 * 1024, ge=1024)
    max_sessions_per_claim: int = Field(default=64, ge=1)
    # Empty: `<data_dir>/attachments`.
    attachments_dir: Path | None = None
    # How often WatchSessionEvents looks for events committed by other processes.
    events_poll_seconds: float = Field(default=1.0, gt=0)

    # Follow: frames a follower may lag behind before resync(OVERFLOW); replayable frames for resume.
    follow_queue_bound: int = Field(default=4096, ge=16)
    follow_replay_frames: int = Field(default=1024, ge=16)
    follow_heartbeat_seconds: float = Field(default=5.0, gt=0)
    # Message ids reserved at once by a publisher, and how long an unused publisher lives.
    publisher_id_block: int = Field(default=1024, ge=1)
    publisher_idle_seconds: float = Field(default=300.0, gt=0)

    def resolved_attachments_dir(self) -> Path:
        """Where attachment bytes live (a volume in production)."""
        return self.attachments_dir or self.data_dir / "attachments"
