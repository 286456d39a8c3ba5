"""One turn: the loop of the reference runtime, run in the background under the session's RUN claim.

    claim = AcquireClaims(RUN, holder=run_id)                 (StartTurn, before the user message)
    PublishBatch(USER message + RuntimeState RUNNING)          (StartTurn; `run_state`)
    memory = the working directory's MEMORY.md entries         (`memory`, read once per turn)
    for each round:
        context = BuildContext(REQUEST_START first, MID_LOOP at each tool-round boundary: a queued
                               compact-now fires there; memory entries, injected unless switched off)
        reply = model(context, the agent's tools + the tools the context offers: HandoffRead, merged only)
        OpenAttempt / AppendChunks (as the reply streams) / CommitAttempt(ASSISTANT)
        no tool calls: done; else run the tools (HandoffRead through handoff-read, for this run id)
        and AppendMessages(TOOL results)
    PublishBatch(RuntimeState IDLE, terminal)                  (always, while the session is the turn's)
    ReleaseClaims                                              (always; renewed meanwhile)

Stop is cooperative: it sets the turn's stop event, which ends a model request or a pause between
streamed pieces at once and is checked between every two upstream calls (a call to transcript is never
cut off mid-way, so no write is left half-done). A claim that can no longer be renewed (its lease
lapsed, an operator released it, or a StopTurn that reached another replica fenced it) stops the turn
the same way: the claim is renewed every `claim_renew_seconds` and once more right before each commit
of an answer and each append of tool results, so a fenced turn commits and appends nothing more. The
open attempt is then settled with CancelAttempt (what was displayed is stored as interrupted) and the
claim released. Logs carry ids and counts only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

from google.protobuf import struct_pb2

from continuum.compaction.v1 import compaction_service_pb2 as capi
from continuum.transcript.v1 import follow_pb2 as fpb
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum_agent import handoff, memory, run_state
from continuum_agent.clients import Upstreams
from continuum_agent.errors import AgentError
from continuum_agent.model import AgentModel, Reply, ToolRequest
from continuum_agent.settings import AgentSettings
from continuum_agent.tools import DEFINITIONS, Workspace, run_tool
from continuum_runtime.clock import Clock
from continuum_runtime.provider import ProviderError
from continuum_runtime.wire_names import HANDOFF_READ_TOOL

logger = logging.getLogger("continuum.agent")
T = TypeVar("T")

SYSTEM_PROMPT = (
    "You are the Continuum reference agent. You can list, read and search the files of the session's "
    "working directory with read-only tools; paths are relative to it. Answer concisely."
)


@dataclass(frozen=True)
class Turn:
    """What a running turn needs to know."""

    user: str
    session_id: str
    run_id: str
    claim_id: str
    workspace: Workspace | None
    # Set by StopTurn (or shutdown).
    stop: asyncio.Event = field(default_factory=asyncio.Event)


class TurnStopped(Exception):
    """The turn was asked to stop."""


async def until_stopped(turn: Turn, work: Awaitable[T]) -> T:
    """`work`'s result, or `TurnStopped` (with `work` cancelled) as soon as the turn is asked to stop."""
    task = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(turn.stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise TurnStopped


def check_stop(turn: Turn) -> None:
    """`TurnStopped` when the turn was asked to stop."""
    if turn.stop.is_set():
        raise TurnStopped


def _metadata(values: dict[str, str]) -> struct_pb2.Struct:
    metadata = struct_pb2.Struct()
    metadata.update(values)
    return metadata


def _text(value: str) -> list[tpb.ContentPart]:
    return [tpb.ContentPart(text=value)] if value else []


class TurnLoop:
    """Runs turns; one instance per process."""

    def __init__(self, settings: AgentSettings, upstreams: Upstreams, model: AgentModel, clock: Clock) -> None:
        self._settings = settings
        self._upstreams = upstreams
        self._model = model
        self._clock = clock

    @property
    def model_name(self) -> str:
        """The model the turns use, as the runtime state names it."""
        return self._model.name

    async def run(self, turn: Turn) -> None:
        """The whole turn; IDLE published and the claim released at the end whatever happens (cancellation
        included)."""
        renewer = asyncio.create_task(self._renew(turn))
        outcome = run_state.FAILED
        try:
            await self._rounds(turn)
            outcome = run_state.COMPLETED
        except TurnStopped:
            outcome = run_state.STOPPED
            logger.info("turn stopped", extra={"session_id": turn.session_id, "run_id": turn.run_id})
        except AgentError as error:
            logger.warning(
                "turn failed", extra={"session_id": turn.session_id, "run_id": turn.run_id, "reason": error.reason}
            )
            await self._failure_note(turn, error)
        except Exception:
            logger.exception("turn crashed", extra={"session_id": turn.session_id, "run_id": turn.run_id})
        finally:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
            # IDLE before the release: once the claim is free a new turn may publish RUNNING, which a
            # later IDLE would hide.
            try:
                await asyncio.shield(
                    run_state.end_turn(
                        self._upstreams,
                        turn.user,
                        turn.session_id,
                        turn.run_id,
                        turn.claim_id,
                        self._settings.claim_ttl_seconds,
                        outcome,
                    )
                )
            finally:
                await asyncio.shield(self._release(turn))

    async def _failure_note(self, turn: Turn, error: AgentError) -> None:
        """Tell the user the turn failed (an answer that never comes would look like a hang)."""
        attempt = fpb.AttemptRef(message_key=f"{turn.run_id}.failed", attempt=1)
        note = Reply([f"The turn failed ({error.reason}); nothing more was done. Try again later."], [])
        try:
            await self._stream(turn, attempt, note)
        except (AgentError, TurnStopped):
            # Transcript itself is unreachable: the log line above is all there is.
            return

    async def _release(self, turn: Turn) -> None:
        try:
            await self._upstreams.release_claim(turn.user, turn.claim_id)
        except AgentError as error:
            # Not fatal: the lease lapses on its own.
            logger.warning("claim not released", extra={"run_id": turn.run_id, "reason": error.reason})

    async def _renew(self, turn: Turn) -> None:
        while True:
            await self._clock.sleep(self._settings.claim_renew_seconds)
            try:
                await self._hold_claim(turn)
            except TurnStopped:
                return
            except AgentError as error:
                # Transcript unreachable for a moment: the lease outlasts a few missed renewals.
                logger.warning("claim not renewed", extra={"run_id": turn.run_id, "reason": error.reason})

    async def _hold_claim(self, turn: Turn) -> None:
        """Renew the claim; `TurnStopped` (and the turn's stop set) when it is no longer held."""
        try:
            await self._upstreams.renew_claim(turn.user, turn.claim_id, self._settings.claim_ttl_seconds)
        except AgentError as error:
            if error.reason != run_state.CLAIM_NOT_HELD:
                raise
            # The lease lapsed or the claim was released: the session is no longer this turn's to write.
            logger.warning("claim not renewed", extra={"run_id": turn.run_id, "reason": error.reason})
            turn.stop.set()
            raise TurnStopped from error

    async def _rounds(self, turn: Turn) -> None:
        # Read once per turn: every request of the turn carries the same entries.
        entries = await asyncio.to_thread(memory.load, turn.workspace, self._settings.memory_limits())
        logger.info("memory loaded", extra={"run_id": turn.run_id, "memory_entries": len(entries)})
        for round_number in range(1, self._settings.max_model_rounds + 1):
            check_stop(turn)
            trigger = capi.TRIGGER_POINT_REQUEST_START if round_number == 1 else capi.TRIGGER_POINT_MID_LOOP
            context = await self._upstreams.build_context(
                turn.user,
                capi.BuildContextRequest(
                    session_id=turn.session_id,
                    run_id=turn.run_id,
                    context_window_tokens=self._settings.context_window_tokens,
                    system_prompt_sections=[capi.PromptSection(key="agent", label="Agent", text=SYSTEM_PROMPT)],
                    memory_entries=entries,
                    trigger_point=trigger,
                ),
            )
            attempt = fpb.AttemptRef(message_key=f"{turn.run_id}.{round_number}", attempt=1)
            offered = handoff.model_definitions(context.tool_definitions)
            handoff_offered = any(d["function"]["name"] == HANDOFF_READ_TOOL for d in offered)
            check_stop(turn)
            try:
                reply = await until_stopped(
                    turn, self._model.reply(context.system_prompt, list(context.messages), DEFINITIONS + offered)
                )
            except ProviderError as error:
                logger.warning("model failed", extra={"run_id": turn.run_id, "reason": error.reason})
                reply = Reply([f"The model provider failed ({error.reason}): {error.message}"], [])
            await self._stream(turn, attempt, reply)
            if not reply.tool_calls:
                return
            results = []
            for call in reply.tool_calls:
                check_stop(turn)
                output = await self._run_tool(turn, call, handoff_offered)
                output = _cap(output, self._settings.tool_result_max_bytes)
                results.append(
                    tpb.NewMessage(
                        role=tpb.MESSAGE_ROLE_TOOL,
                        content=_text(output),
                        tool_call_id=call.call_id,
                        metadata=_metadata({"runId": turn.run_id, "tool": call.name}),
                    )
                )
            check_stop(turn)
            await self._hold_claim(turn)
            await self._upstreams.append(turn.user, turn.session_id, *results)
            logger.info(
                "tool round done", extra={"run_id": turn.run_id, "round": round_number, "tool_calls": len(results)}
            )
        # Rounds ran out with the model still calling tools: say so instead of ending silently.
        attempt = fpb.AttemptRef(message_key=f"{turn.run_id}.end", attempt=1)
        note = f"Stopped after {self._settings.max_model_rounds} model requests without a final answer."
        await self._stream(turn, attempt, Reply([note], []))

    async def _run_tool(self, turn: Turn, call: ToolRequest, handoff_offered: bool) -> str:
        """One tool call's result; HandoffRead runs only in a round whose context offered it (elsewhere it
        is an unknown tool, like any name the model made up)."""
        if call.name == HANDOFF_READ_TOOL and handoff_offered:
            return await until_stopped(
                turn,
                handoff.execute(
                    self._upstreams, turn.user, turn.run_id, call.arguments, self._settings.tool_result_max_bytes
                ),
            )
        return await asyncio.to_thread(run_tool, turn.workspace, call.name, call.arguments)

    async def _stream(self, turn: Turn, attempt: fpb.AttemptRef, reply: Reply) -> None:
        """Show the reply as it is written, then store it; a stop in between stores what was shown."""
        await self._upstreams.open_attempt(turn.user, turn.session_id, attempt)
        settled = False
        try:
            next_index = 0
            for delta in reply.deltas:
                if reply.delta_seconds:
                    await until_stopped(turn, self._clock.sleep(reply.delta_seconds))
                check_stop(turn)
                pieces = [
                    delta[i : i + self._settings.chunk_max_chars]
                    for i in range(0, len(delta), self._settings.chunk_max_chars)
                ]
                if pieces:
                    next_index = await self._upstreams.append_chunks(
                        turn.user, turn.session_id, attempt, next_index, pieces
                    )
            message = tpb.NewMessage(
                role=tpb.MESSAGE_ROLE_ASSISTANT,
                content=_text(reply.text),
                tool_calls=[
                    tpb.ToolCall(tool_call_id=call.call_id, name=call.name, arguments=call.arguments)
                    for call in reply.tool_calls
                ],
                metadata=_metadata({"runId": turn.run_id, "model": self._model.name}),
            )
            check_stop(turn)
            await self._hold_claim(turn)
            await self._upstreams.commit_attempt(turn.user, turn.session_id, attempt, message)
            settled = True
        finally:
            if not settled:
                await asyncio.shield(self._cancel(turn, attempt))

    async def _cancel(self, turn: Turn, attempt: fpb.AttemptRef) -> None:
        try:
            await self._upstreams.cancel_attempt(turn.user, turn.session_id, attempt)
        except AgentError as error:
            logger.warning("attempt not cancelled", extra={"run_id": turn.run_id, "reason": error.reason})


def _cap(output: str, max_bytes: int) -> str:
    """A tool result within `max_bytes`; a longer one is replaced by a note that says it was truncated."""
    if len(output.encode()) <= max_bytes:
        return output
    return '{"error": "the result is larger than the agent accepts", "truncated": true}'
