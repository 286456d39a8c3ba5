"""The budgets of extraction, kept apart, and how patiently a model call is made.

Five quantities, never mixed: storage bytes (the snapshot's, not budgeted here), request bytes (a
guard), estimated input tokens (what a request may carry), visible output tokens (a target, not a
cap on what is kept) and the provider's reported usage (reasoning included; recorded, never used to
accept or refuse an answer). All figures are `MERGE_EXTRACTION__*` settings; the defaults are
issue 10's:

- material per request: 16,384 estimated tokens minus the instructions, the request's JSON wrapping,
  the visible output target and a safety margin of max(1024, 5% of the model's window); never more
  than the window leaves once the generation (visible target plus thinking reserve) and the margin
  are taken out.
- thinking reserve: min(32,768, window / 4) when the model thinks, within its max output beside the
  visible target; sent as part of the request's max_tokens.
- visible output and brief targets: 2,048 estimated tokens each.
- byte guards: 1 MiB per request, 256 KiB per visible answer.
- per call: 300 s; 3 attempts per unit and model, 2 s then 5 s apart or what Retry-After asks.
- shrink floor: 256 estimated tokens of material (a unit that small is not split again).

There is no cap on the number of calls and no deadline for the whole task: termination comes from
bounded inputs, strictly smaller split units, bounded attempts and shrinking aggregation layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from continuum_merge.extraction.plan import MIN_MATERIAL_TOKENS, UnitBudget
from continuum_merge.extraction.prompts import CONDENSE_INSTRUCTIONS, EXTRACT_INSTRUCTIONS, instruction_tokens
from continuum_runtime.clock import Clock, SystemClock

__all__ = ["CallPolicy", "ExtractionSettings"]

# The most thinking reserved, whatever the window (seed 000 §6.3).
MAX_THINKING_TOKENS = 32_768
# The request's JSON frame around the inputs (braces, key names, a repair note).
WRAPPING_TOKENS = 128


class ExtractionSettings(BaseModel):
    """Budgets and call patience of extraction and aggregation (`MERGE_EXTRACTION__*`)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    # The request target in estimated tokens: material plus instructions, wrapping, visible output, margin.
    request_tokens: int = Field(default=16_384, ge=1024)
    # The model's context window in estimated tokens (the margin is 5% of it, at least 1024).
    context_window_tokens: int = Field(default=128_000, ge=2048)
    # The most the model may generate per call, thinking included (the provider's max output).
    max_output_tokens: int = Field(default=8_192, ge=64)
    # Whether the model reasons before answering: then a thinking reserve is added to max_tokens.
    supports_thinking: bool = False
    # Targets, not caps: a complete, valid answer over them is kept.
    visible_output_tokens: int = Field(default=2_048, ge=64)
    brief_tokens: int = Field(default=2_048, ge=64)
    # Byte guards: a request over the first is not sent, an answer over the second is not used (split).
    request_bytes: int = Field(default=1024 * 1024, ge=4096)
    response_bytes: int = Field(default=256 * 1024, ge=1024)
    # One model call, from sending to the last byte of its answer.
    call_timeout_seconds: float = Field(default=300.0, gt=0)
    # Calls per request for one unit and model: the first and its retries on 429, 5xx, network, timeout.
    attempts: int = Field(default=3, ge=1, le=10)
    # Waits before the 2nd, 3rd, ... attempt (the last repeats); a Retry-After the server sends wins.
    backoff_seconds: tuple[float, ...] = (2.0, 5.0)
    # A Retry-After longer than this is cut to it.
    max_retry_after_seconds: float = Field(default=120.0, ge=0)
    # A unit whose own material is this small is not split again: it pauses the operation.
    shrink_floor_tokens: int = Field(default=MIN_MATERIAL_TOKENS, ge=MIN_MATERIAL_TOKENS)

    @model_validator(mode="after")
    def _budget_leaves_material(self) -> Self:
        if not self.backoff_seconds or any(not math.isfinite(s) or s < 0 for s in self.backoff_seconds):
            raise ValueError("backoff_seconds needs at least one non-negative wait")
        if self.visible_output_tokens > self.max_output_tokens:
            raise ValueError("visible_output_tokens must be within max_output_tokens")
        self.unit_budget()  # raises ValueError when nothing is left for material
        return self

    @property
    def safety_tokens(self) -> int:
        """The margin for estimation error: max(1024, 5% of the window)."""
        return max(1024, math.ceil(self.context_window_tokens * 0.05))

    @property
    def thinking_tokens(self) -> int:
        """Reserved for reasoning: min(32,768, window / 4) beside the visible target within the max output."""
        if not self.supports_thinking:
            return 0
        reserve = min(MAX_THINKING_TOKENS, self.context_window_tokens // 4)
        return max(0, min(reserve, self.max_output_tokens - self.visible_output_tokens))

    def unit_budget(self) -> UnitBudget:
        """The per-request budget of units and condensing packs; ValueError when it leaves no material.

        The request target is cut to what the window leaves after the thinking reserve, so the whole
        request with its generation and margin always fits the window.
        """
        request = min(self.request_tokens, self.context_window_tokens - self.thinking_tokens)
        return UnitBudget(
            request_tokens=request,
            output_tokens=self.visible_output_tokens,
            thinking_tokens=self.thinking_tokens,
            safety_tokens=self.safety_tokens,
            instruction_tokens=max(map(instruction_tokens, (EXTRACT_INSTRUCTIONS, CONDENSE_INSTRUCTIONS)))
            + WRAPPING_TOKENS,
            request_bytes=self.request_bytes,
            response_bytes=self.response_bytes,
            floor_tokens=self.shrink_floor_tokens,
        )

    def call_policy(self, clock: Clock) -> CallPolicy:
        """How each model call is made, waiting on `clock`."""
        return CallPolicy(
            attempts=self.attempts,
            backoff_seconds=self.backoff_seconds,
            max_retry_after_seconds=self.max_retry_after_seconds,
            timeout_seconds=self.call_timeout_seconds,
            clock=clock,
        )


@dataclass(frozen=True)
class CallPolicy:
    """Attempts, waits and the per-call timeout of one request; the clock is injected (tests move it)."""

    attempts: int = 3
    backoff_seconds: tuple[float, ...] = (2.0, 5.0)
    max_retry_after_seconds: float = 120.0
    timeout_seconds: float = 300.0
    clock: Clock = field(default_factory=SystemClock)

    def delay(self, retry: int, retry_after: float | None) -> float:
        """Seconds before retry number `retry` (1 for the first): Retry-After when given, else the backoff."""
        if retry_after is not None:
            return min(retry_after, self.max_retry_after_seconds)
        return self.backoff_seconds[min(retry, len(self.backoff_seconds)) - 1]
