"""StopTurn for a turn this process does not run: another replica runs it (or this process before a
restart). The turn is fenced through its RUN claim, which every replica's loop checks.

The run is found in transcript, not in memory: every message a turn writes carries its run id in its
metadata, and a running turn's messages are the session's newest (its user message is stored before
it begins), so the newest of the latest `LOOKBACK_MESSAGES` messages that names a run names the running
one, if any runs. When transcript says that run still holds its claim, the claim is released: the
running loop sees CLAIM_NOT_HELD at its next renewal or before its next write, whichever comes first,
and stops there the way a local stop does (what was shown is stored as interrupted; nothing is
committed or appended after the release).
"""

from __future__ import annotations

import logging

from continuum_agent.clients import Upstreams

logger = logging.getLogger("continuum.agent")

# The newest messages looked at: a running turn has written at least its user message by then.
LOOKBACK_MESSAGES = 8


async def stop_elsewhere(upstreams: Upstreams, user: str, session_id: str) -> bool:
    """Fence the session's running turn through its claim; False when no turn of the session runs."""
    run_id = await _newest_run(upstreams, user, session_id)
    if not run_id or not await upstreams.run_is_live(user, run_id):
        return False
    released = await upstreams.release_run(user, run_id)
    logger.info("turn fenced for another replica", extra={"session_id": session_id, "run_id": run_id})
    return released


async def _newest_run(upstreams: Upstreams, user: str, session_id: str) -> str:
    page = await upstreams.latest_messages(user, session_id, 0, LOOKBACK_MESSAGES)
    for message in reversed(page.messages):
        if message.body_deferred:
            # A stub leaves its metadata out; the agent's own messages are bounded (its tool results
            # and a user's text), so reading one whole stays bounded too.
            message = await upstreams.get_message(user, session_id, message.message_id)
        run = message.metadata.fields.get("runId")
        if run is not None and run.string_value:
            return run.string_value
    return ""
