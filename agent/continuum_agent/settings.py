"""Agent settings, read once at start from `AGENT_*` environment variables."""

from __future__ import annotations

from typing import Self

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from continuum_agent.memory import MemoryLimits
from continuum_runtime.provider import ProviderSettings
from continuum_runtime.settings import ServiceSettings


class AgentSettings(ServiceSettings):
    """The agent keeps nothing persistent: the database fields of `ServiceSettings` are unused."""

    model_config = SettingsConfigDict(
        env_prefix="AGENT_",
        env_nested_delimiter="__",
        frozen=True,
        extra="ignore",
        hide_input_in_errors=True,
    )

    port: int = Field(default=50154, ge=0, le=65535)
    # host:port of transcript, compaction and handoff-read; all accept the same service token.
    transcript_address: str = "127.0.0.1:50151"
    compaction_address: str = "127.0.0.1:50152"
    # Called only for a HandoffRead tool call, which BuildContext offers for merged sessions alone.
    handoff_read_address: str = "127.0.0.1:50155"
    # Deadline of one call to transcript or compaction (BuildContext may summarize first: long).
    transcript_timeout_seconds: float = Field(default=30.0, gt=0)
    compaction_timeout_seconds: float = Field(default=600.0, gt=0)
    # Handoff-read answers within its own 15 s budget; this deadline only covers the way there and back.
    handoff_read_timeout_seconds: float = Field(default=20.0, gt=0)

    # Lease of a turn's RUN claim: a killed agent stops blocking its sessions after this long at most.
    claim_ttl_seconds: float = Field(default=15.0, ge=1, le=3600)
    # The claim is renewed this often while the turn runs, well inside the lease. It is also how soon a
    # turn that a StopTurn at another replica fenced notices it (writes check the claim at once).
    claim_renew_seconds: float = Field(default=2.0, gt=0)
    # Model requests of one turn (each followed by a tool round unless the model answers).
    max_model_rounds: int = Field(default=8, ge=1, le=100)
    # Turns this process runs at once (across all sessions).
    max_running_turns: int = Field(default=64, ge=1)
    # The model's context window, passed to BuildContext; 0 lets compaction use its default.
    context_window_tokens: int = Field(default=0, ge=0)
    # The answer is streamed to transcript in pieces of at most this many characters, one piece per
    # model delta (the offline provider's deltas are words, paced by `offline_delta_seconds`).
    chunk_max_chars: int = Field(default=4096, ge=1, le=16384)
    # Pause between the offline model's streamed words, so a person sees an answer being written.
    offline_delta_seconds: float = Field(default=0.03, ge=0)
    # A tool result's largest size in bytes; a file read gives at most half of it (the result then says
    # "truncated": true), and a larger result is replaced by a refusal that says so.
    tool_result_max_bytes: int = Field(default=64 * 1024, ge=1024, le=4 * 1024 * 1024)
    # The memory file at the top of a session's working directory: one entry per bullet (`memory`).
    # At most this many bytes of it are read; at most this many entries, each and all together within
    # these byte limits, go into a request (compaction takes at most 64 entries of 16 KiB each).
    memory_file: str = Field(default="MEMORY.md", min_length=1, max_length=255, pattern=r"^[^/\\\x00]+$")
    memory_max_file_bytes: int = Field(default=64 * 1024, ge=1, le=4 * 1024 * 1024)
    memory_max_entries: int = Field(default=32, ge=1, le=64)
    memory_max_entry_bytes: int = Field(default=2048, ge=1, le=16 * 1024)
    memory_max_total_bytes: int = Field(default=16 * 1024, ge=1, le=1024 * 1024)
    # client_request_ids remembered per process for idempotent StartTurn retries.
    remembered_requests: int = Field(default=4096, ge=1)
    # A retry this process does not remember (after a restart, or sent to another replica) is looked up
    # among the session's latest messages: at most this many messages, and this many USER messages. A
    # client retries a request until it is answered, so its message is among the newest turns; the
    # default is one page of transcript's (at most 1 MiB of inline bodies), read on every StartTurn
    # that carries an id.
    replay_lookback_messages: int = Field(default=200, ge=1, le=10_000)
    replay_lookback_user_messages: int = Field(default=8, ge=1, le=1000)

    # AGENT_PROVIDER__KIND=openai, AGENT_PROVIDER__BASE_URL=..., etc.; offline by default.
    provider: ProviderSettings = ProviderSettings()

    def memory_limits(self) -> MemoryLimits:
        """What one turn reads of the memory file and carries of it."""
        return MemoryLimits(
            self.memory_file,
            self.memory_max_file_bytes,
            self.memory_max_entries,
            self.memory_max_entry_bytes,
            self.memory_max_total_bytes,
        )

    @model_validator(mode="after")
    def _renewal_within_lease(self) -> Self:
        if self.claim_renew_seconds >= self.claim_ttl_seconds:
            raise ValueError("claim_renew_seconds must be shorter than claim_ttl_seconds")
        return self
