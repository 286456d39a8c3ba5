"""The session's runtime state, published through transcript's PublishBatch so every follower shows it.

A turn's user message and RUNNING (with the turn's run id) travel in one batch: a follower that sees the
message sees the turn running, before any answer streams. IDLE follows when the turn ends, however it
ends (answered, stopped, failed), as a terminal batch (followers see it once it is durable), published
while the session is still the turn's: under the turn's own RUN claim, or, when that claim was taken
away (a StopTurn that reached another replica, an operator, a lapsed lease), under a RUN claim taken for
that one write. A session another turn holds by then is left alone: that turn published its own RUNNING.
(A RUN claim holds a whole session tree, so a turn of another session of the tree holding it leaves this
session's RUNNING in place too, until its next turn or a StopTurn.)

A StopTurn that finds no running turn publishes IDLE the same way. That clears the RUNNING an agent
killed mid-turn leaves behind; nothing else does (no watchdog decides that a turn ended).
"""

from __future__ import annotations

import logging
import uuid

from google.protobuf import struct_pb2

from continuum.transcript.v1 import error_reason_pb2 as transcript_reasons
from continuum.transcript.v1 import follow_pb2 as fpb
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum_agent.clients import Upstreams
from continuum_agent.errors import AgentError, UpstreamRefused

logger = logging.getLogger("continuum.agent")
CLAIM_NOT_HELD = transcript_reasons.ErrorReason.Name(transcript_reasons.CLAIM_NOT_HELD)
SESSION_ALREADY_RUNNING = transcript_reasons.ErrorReason.Name(transcript_reasons.SESSION_ALREADY_RUNNING)
# How a turn ended, in the IDLE state's details.
COMPLETED = "completed"
STOPPED = "stopped"
FAILED = "failed"
# The RUN claim taken only to publish IDLE lasts at most this long if the agent dies meanwhile.
IDLE_CLAIM_TTL_SECONDS = 5.0


def _details(values: dict[str, str]) -> struct_pb2.Struct:
    details = struct_pb2.Struct()
    details.update(values)
    return details


async def start_turn(
    upstreams: Upstreams, user: str, session_id: str, run_id: str, message: tpb.NewMessage, model: str
) -> int:
    """Store the turn's user message and publish RUNNING in one batch; the message's id."""
    running = fpb.RuntimeState(state=fpb.RUN_STATE_RUNNING, run_id=run_id, details=_details({"model": model}))
    response = await upstreams.publish(
        user,
        session_id,
        [api.BatchOperation(message=message), api.BatchOperation(runtime_state=running)],
    )
    [message_id] = response.message_ids
    return message_id


async def end_turn(
    upstreams: Upstreams, user: str, session_id: str, run_id: str, claim_id: str, ttl_seconds: float, outcome: str
) -> None:
    """Publish IDLE after turn `run_id` (its claim `claim_id` not yet released); never raises."""
    try:
        await upstreams.renew_claim(user, claim_id, ttl_seconds)
    except AgentError as error:
        if error.reason != CLAIM_NOT_HELD:
            logger.warning("runtime state not published", extra={"run_id": run_id, "reason": error.reason})
            return
        await publish_idle(upstreams, user, session_id, run_id, outcome)
        return
    await _publish_idle(upstreams, user, session_id, run_id, outcome)


async def publish_idle(upstreams: Upstreams, user: str, session_id: str, last_run_id: str, outcome: str) -> None:
    """Publish IDLE under a RUN claim taken for the write, unless a turn holds the session; never raises."""
    holder = last_run_id or f"idle-{uuid.uuid4().hex}"
    try:
        claim_id = await upstreams.acquire_run_claim(user, session_id, holder, IDLE_CLAIM_TTL_SECONDS)
    except UpstreamRefused as refused:
        if refused.reason != SESSION_ALREADY_RUNNING:
            logger.warning("runtime state not published", extra={"session_id": session_id, "reason": refused.reason})
            return
        if refused.metadata.get("holder_kind") == tpb.ClaimKind.Name(tpb.CLAIM_KIND_RUN):
            # Another turn holds the session: its RUNNING is the state to show.
            return
        # A merge or compaction holds it: no turn runs, and none can start before that claim ends.
        await _publish_idle(upstreams, user, session_id, last_run_id, outcome)
        return
    except AgentError as error:
        logger.warning("runtime state not published", extra={"session_id": session_id, "reason": error.reason})
        return
    try:
        await _publish_idle(upstreams, user, session_id, last_run_id, outcome)
    finally:
        try:
            await upstreams.release_claim(user, claim_id)
        except AgentError as error:
            # Not fatal: the short lease lapses on its own.
            logger.warning("claim not released", extra={"session_id": session_id, "reason": error.reason})


async def _publish_idle(upstreams: Upstreams, user: str, session_id: str, last_run_id: str, outcome: str) -> None:
    values = {"outcome": outcome, **({"lastRunId": last_run_id} if last_run_id else {})}
    idle = fpb.RuntimeState(state=fpb.RUN_STATE_IDLE, details=_details(values))
    try:
        await upstreams.publish(user, session_id, [api.BatchOperation(runtime_state=idle)], terminal=True)
    except AgentError as error:
        logger.warning("runtime state not published", extra={"session_id": session_id, "reason": error.reason})
