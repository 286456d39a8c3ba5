"""StartTurn and StopTurn: admit a turn (claim, user message), run it in the background, stop it.

Running turns are known to this process only (the agent keeps nothing persistent): StopTurn stops a
turn this process runs directly, and one another replica runs by fencing its RUN claim (`stops`). A
repeated client_request_id is answered from memory (the most recent `remembered_requests` of this
process), else from transcript (`replays`): the user message of the first call keeps the id, so a retry
after a restart, or at another replica, answers the same turn instead of appending the message twice.
The transcript lookup runs under the session's RUN claim (nobody else can start a turn then), or, when
a running turn holds the claim, against the message that turn appended before it began.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from google.protobuf import struct_pb2

from continuum.transcript.v1 import resources_pb2 as tpb
from continuum_agent import run_state
from continuum_agent.clients import Upstreams
from continuum_agent.errors import (
    AgentError,
    ClientRequestIdReused,
    TooManyTurns,
    TurnAlreadyRunning,
    UpstreamRefused,
)
from continuum_agent.replays import Lookback, Started, find_started
from continuum_agent.settings import AgentSettings
from continuum_agent.stops import stop_elsewhere
from continuum_agent.tools import Workspace
from continuum_agent.turn import Turn, TurnLoop

logger = logging.getLogger("continuum.agent")


@dataclass(frozen=True)
class _Remembered:
    session_id: str
    text_hash: int
    started: Started


class TurnRunner:
    """Admits, tracks and stops this process's turns."""

    def __init__(self, settings: AgentSettings, upstreams: Upstreams, loop: TurnLoop) -> None:
        self._settings = settings
        self._upstreams = upstreams
        self._loop = loop
        # (user, session_id) -> the running turn and its task.
        self._running: dict[tuple[str, str], tuple[Turn, asyncio.Task[None]]] = {}
        self._starting: set[tuple[str, str]] = set()
        self._requests: OrderedDict[tuple[str, str], _Remembered] = OrderedDict()
        # (user, client_request_id) -> a lock and how many calls use it (dropped when none does).
        self._request_locks: dict[tuple[str, str], tuple[asyncio.Lock, int]] = {}

    async def start(self, user: str, session_id: str, text: str, client_request_id: str) -> Started:
        """Admit a turn and start it; see the StartTurn contract."""
        if not client_request_id:
            return await self._start(user, session_id, text, "")
        key = (user, client_request_id)
        lock, users = self._request_locks.get(key, (asyncio.Lock(), 0))
        self._request_locks[key] = (lock, users + 1)
        try:
            async with lock:
                remembered = self._requests.get(key)
                if remembered is not None:
                    if remembered.session_id != session_id or remembered.text_hash != hash(text):
                        raise ClientRequestIdReused("client_request_id was used for another session or text")
                    return remembered.started
                started = await self._start(user, session_id, text, client_request_id)
                self._requests[key] = _Remembered(session_id, hash(text), started)
                while len(self._requests) > self._settings.remembered_requests:
                    self._requests.popitem(last=False)
                return started
        finally:
            lock, users = self._request_locks[key]
            if users == 1:
                del self._request_locks[key]
            else:
                self._request_locks[key] = (lock, users - 1)

    async def _start(self, user: str, session_id: str, text: str, client_request_id: str) -> Started:
        key = (user, session_id)
        if key in self._running or key in self._starting:
            # This process forgot the request (its memory is bounded) but may still run its turn.
            replayed = await self._replayed(user, session_id, text, client_request_id)
            if replayed is not None:
                return replayed
            raise TurnAlreadyRunning("a turn of this session is already running", metadata={"session_id": session_id})
        if len(self._running) + len(self._starting) >= self._settings.max_running_turns:
            raise TooManyTurns("this agent runs as many turns as it may; retry later")
        self._starting.add(key)
        try:
            session = await self._upstreams.get_session(user, session_id)
            run_id = f"run-{uuid.uuid4().hex}"
            try:
                claim_id = await self._upstreams.acquire_run_claim(
                    user, session_id, run_id, self._settings.claim_ttl_seconds
                )
            except UpstreamRefused as refused:
                # Perhaps the first call of this very request, still running (here before a restart, or
                # at another replica): its user message is stored before its turn begins.
                if client_request_id and refused.reason == run_state.SESSION_ALREADY_RUNNING:
                    replayed = await self._replayed(user, session_id, text, client_request_id)
                    if replayed is not None:
                        return replayed
                raise
            try:
                replayed = await self._replayed(user, session_id, text, client_request_id)
                if replayed is not None:
                    await asyncio.shield(self._release_quietly(user, claim_id))
                    return replayed
                metadata = struct_pb2.Struct()
                metadata.update(
                    {"runId": run_id, **({"clientRequestId": client_request_id} if client_request_id else {})}
                )
                message = tpb.NewMessage(
                    role=tpb.MESSAGE_ROLE_USER, content=[tpb.ContentPart(text=text)], metadata=metadata
                )
                message_id = await run_state.start_turn(
                    self._upstreams, user, session_id, run_id, message, self._loop.model_name
                )
            except BaseException:
                await asyncio.shield(self._release_quietly(user, claim_id))
                raise
            # A file's text takes at most half of a result: its JSON escaping fits in the rest.
            workspace = Workspace.of(session.working_directory, self._settings.tool_result_max_bytes // 2)
            turn = Turn(user, session_id, run_id, claim_id, workspace)
            task = asyncio.create_task(self._loop.run(turn), name=f"turn:{run_id}")
            self._running[key] = (turn, task)
            task.add_done_callback(lambda done: self._finished(key, done))
        finally:
            self._starting.discard(key)
        logger.info("turn started", extra={"session_id": session_id, "run_id": run_id, "message_id": message_id})
        return Started(run_id, message_id)

    async def _replayed(self, user: str, session_id: str, text: str, client_request_id: str) -> Started | None:
        """The turn an earlier call with `client_request_id` started, found in transcript."""
        if not client_request_id:
            return None
        lookback = Lookback(self._settings.replay_lookback_messages, self._settings.replay_lookback_user_messages)
        started = await find_started(self._upstreams, user, session_id, text, client_request_id, lookback)
        if started is not None:
            logger.info("turn request replayed", extra={"session_id": session_id, "run_id": started.run_id})
        return started

    async def _release_quietly(self, user: str, claim_id: str) -> None:
        with contextlib.suppress(AgentError):
            await self._upstreams.release_claim(user, claim_id)

    def _finished(self, key: tuple[str, str], task: asyncio.Task[None]) -> None:
        running = self._running.get(key)
        if running is not None and running[1] is task:
            del self._running[key]

    async def stop(self, user: str, session_id: str) -> bool:
        """Stop the session's running turn; False when none runs.

        A turn of this process is waited for until it settled. A turn of another replica is fenced
        through its claim and settles there at its next renewal or write (`stops`). With no turn
        running, the session's runtime state is set IDLE.
        """
        running = self._running.get((user, session_id))
        if running is None or running[1].done():
            if await stop_elsewhere(self._upstreams, user, session_id):
                return True
            # No turn runs anywhere: clear a RUNNING that a killed agent left (`run_state`).
            await run_state.publish_idle(self._upstreams, user, session_id, "", run_state.STOPPED)
            return False
        turn, task = running
        turn.stop.set()
        await asyncio.wait([task])
        return True

    async def stop_all(self) -> None:
        """Stop every running turn (at shutdown): partial answers stored as interrupted, claims released."""
        tasks = []
        for turn, task in list(self._running.values()):
            turn.stop.set()
            tasks.append(task)
        if tasks:
            await asyncio.wait(tasks)
