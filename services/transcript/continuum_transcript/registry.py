"""The publishers this process owns: one per session, created on first use, reaped when idle."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging

from continuum.transcript.v1 import follow_pb2 as fpb
from continuum_runtime.clock import Clock
from continuum_runtime.database import Database
from continuum_transcript import persistence, sessions
from continuum_transcript.publisher import PublisherLimits, SessionPublisher
from continuum_transcript.settings import TranscriptSettings

logger = logging.getLogger("continuum.transcript.registry")


class PublisherRegistry:
    """Finds or binds the publisher of a session. Binding bumps the session's stream generation, so a
    publisher that restarted (here or elsewhere) is a rebind every follower notices."""

    def __init__(self, database: Database, settings: TranscriptSettings, clock: Clock) -> None:
        self._db = database
        self._settings = settings
        self._clock = clock
        self._publishers: dict[str, SessionPublisher] = {}
        # Sessions being bound: a lock each, and how many callers hold or wait for it. An entry lives
        # only while somebody binds, so the map stays as small as the binds in flight.
        self._binding: dict[str, asyncio.Lock] = {}
        self._binders: collections.Counter[str] = collections.Counter()
        self._reaper: asyncio.Task[None] | None = None
        # Idle publishers and since when (the loop's time): only publishers bound now.
        self._idle_since: dict[SessionPublisher, float] = {}
        # How many times the reaper looked (diagnostics, and tests waiting for a look).
        self.reaper_passes = 0

    def start(self) -> None:
        """Begin reaping idle publishers."""
        self._reaper = asyncio.create_task(self._reap_forever(), name="publisher-reaper")

    async def get(self, owner: str, session_id: str) -> SessionPublisher:
        """The live publisher of one of `owner`'s sessions (ownership checked every time)."""
        publisher = self._publishers.get(session_id)
        if publisher is not None and not publisher.closed:
            if publisher.owner != owner:
                async with self._db.connection() as connection:
                    await sessions.load(connection, owner, session_id)  # raises the right refusal
            return publisher
        lock = self._binding.setdefault(session_id, asyncio.Lock())
        self._binders[session_id] += 1
        try:
            async with lock:
                return await self._bind(owner, session_id)
        finally:
            self._binders[session_id] -= 1
            if not self._binders[session_id]:
                del self._binders[session_id], self._binding[session_id]

    async def _bind(self, owner: str, session_id: str) -> SessionPublisher:
        """The session's publisher, bound now unless a caller ahead in the lock just did."""
        publisher = self._publishers.get(session_id)
        if publisher is not None and not publisher.closed and publisher.owner == owner:
            return publisher
        async with self._db.connection() as connection:
            row = await sessions.load(connection, owner, session_id)
        binding = await persistence.bind(self._db, session_id, self._clock.now_ms())
        publisher = SessionPublisher(
            session_id,
            row["owner"],
            binding,
            self._db,
            PublisherLimits.of(self._settings),
            on_closed=self._forget,
            clock=self._clock,
        )
        self._publishers[session_id] = publisher
        logger.info(
            "publisher bound",
            extra={
                "session_id": session_id,
                "stream_generation": binding.stream_generation,
                "durable_seq": binding.durable_seq,
            },
        )
        return publisher

    def _forget(self, publisher: SessionPublisher) -> None:
        if self._publishers.get(publisher.session_id) is publisher:
            del self._publishers[publisher.session_id]

    def end_sessions(self, session_ids: list[str]) -> None:
        """Deleted sessions: their followers get resync(REWRITE) and then NOT_FOUND on re-follow."""
        for session_id in session_ids:
            publisher = self._publishers.get(session_id)
            if publisher is not None:
                publisher.close(fpb.RESYNC_REASON_REWRITE)

    async def _reap_forever(self) -> None:
        interval = min(self._settings.publisher_idle_seconds, 30.0)
        # Real time, not the injected clock's: a background loop on a test's manual clock would be one
        # more sleeper for every test that counts them. An abandoned attempt's age is the clock's.
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            now = loop.time()
            self.reaper_passes += 1
            # Rebuilt from the publishers bound now on every pass: one closed otherwise (its session
            # deleted, fenced out) leaves nothing behind, and a session bound anew starts afresh.
            self._idle_since = {
                publisher: self._idle_since.get(publisher, now)
                for publisher in list(self._publishers.values())
                if publisher.idle
            }
            for publisher, since in list(self._idle_since.items()):
                if now - since >= self._settings.publisher_idle_seconds:
                    del self._idle_since[publisher]
                    await publisher.drain_and_close(fpb.RESYNC_REASON_REBIND, grace_seconds=5.0)

    async def shutdown(self, grace_seconds: float) -> None:
        """Flush what every publisher accepted (bounded), end all followers, stop."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await asyncio.gather(
            *[p.drain_and_close(fpb.RESYNC_REASON_SHUTDOWN, grace_seconds) for p in list(self._publishers.values())]
        )
