"""Transcript settings, read once at start from `TRANSCRIPT_*` environment variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from continuum_runtime.settings import ServiceSettings
from continuum_transcript.bodies import STORED_PREVIEW_BYTES, Limits


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

    # Nothing a client reads grows with the history (see bodies.py). A message travels whole in a
    # page or frame only when its body is within `inline_body_bytes` and the page or frame has not
    # inlined `frame_bytes` of bodies yet; otherwise it travels as a stub, loaded on demand by id.
    inline_body_bytes: int = Field(default=64 * 1024, ge=STORED_PREVIEW_BYTES)
    frame_bytes: int = Field(default=1024 * 1024, ge=64 * 1024)
    # ListMessagesAfter (whole bodies, for backends) stops a page once its bodies hold this much.
    list_page_bytes: int = Field(default=8 * 1024 * 1024, ge=1024 * 1024)

    # Follow: frames a follower may lag behind before resync(OVERFLOW) (and their bytes); frames kept
    # for resuming (and their bytes).
    follow_queue_bound: int = Field(default=4096, ge=16)
    follow_queue_bytes: int = Field(default=16 * 1024 * 1024, ge=1024 * 1024)
    follow_replay_frames: int = Field(default=1024, ge=16)
    follow_replay_bytes: int = Field(default=8 * 1024 * 1024, ge=1024 * 1024)
    follow_heartbeat_seconds: float = Field(default=5.0, gt=0)
    # Sampling: the largest chunk, open attempts per session, and the text one attempt may stream.
    max_chunk_bytes: int = Field(default=64 * 1024, ge=1024)
    max_open_attempts: int = Field(default=8, ge=1)
    # Pending prompts per session, and the operations of a batch other than messages, together.
    max_pending_prompts: int = Field(default=64, ge=1)
    max_batch_extras_bytes: int = Field(default=256 * 1024, ge=64 * 1024)
    # Accepted batches waiting to be saved (the database is slow or down): past this many bytes a
    # new batch is refused with UNAVAILABLE PUBLISH_BACKLOG_FULL instead of growing memory.
    publish_backlog_bytes: int = Field(default=64 * 1024 * 1024, ge=1024 * 1024)
    # Message ids reserved at once by a publisher, and how long an unused publisher lives (a sampling
    # attempt that shows nothing for as long counts as abandoned and does not keep it).
    publisher_id_block: int = Field(default=8192, ge=1)
    publisher_idle_seconds: float = Field(default=300.0, gt=0)

    def limits(self) -> Limits:
        """When a message travels whole in a page or frame."""
        return Limits(inline_bytes=self.inline_body_bytes, budget_bytes=self.frame_bytes)

    def resolved_attachments_dir(self) -> Path:
        """Where attachment bytes live (a volume in production)."""
        return self.attachments_dir or self.data_dir / "attachments"
