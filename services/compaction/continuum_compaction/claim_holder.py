"""Whose claims an idle manual compaction takes: this replica's, under a name its next start knows.

A replica killed while it compacts leaves its `compaction` claim behind until the lease ends. The
claim's holder is `compaction:<instance>`, the same for every start of one replica, so a restarted
replica releases what it held at once, before it takes a claim of its own. The name must never be
shared by two live replicas (a start would free claims the other still relies on). By default it is
`<host name>@<bind address>:<port>`: the release runs after the address was bound, and no two live
processes bind one host's address and port (the server disables SO_REUSEPORT). A Kubernetes pod keeps
its name across container restarts. On port 0 the port differs at every start, so the name is made
unique to this start and a crashed predecessor's claims lapse with their lease instead.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid

from continuum_compaction.errors import CompactionError
from continuum_compaction.settings import CompactionSettings
from continuum_compaction.transcript_client import TranscriptClient

logger = logging.getLogger("continuum.compaction")

HOLDER_PREFIX = "compaction:"


def instance_name(settings: CompactionSettings) -> tuple[str, bool]:
    """This replica's name and whether a previous start can have held claims under it."""
    if settings.instance_id:
        return settings.instance_id, True
    if settings.port:
        return f"{socket.gethostname()}@{settings.host}:{settings.port}", True
    return f"{socket.gethostname()}@{uuid.uuid4().hex}", False


class ClaimHolder:
    """The holder this replica's claims carry, usable once its predecessor's claims are released."""

    def __init__(self, settings: CompactionSettings, transcript: TranscriptClient) -> None:
        instance, inherits = instance_name(settings)
        self.name = HOLDER_PREFIX + instance
        self._transcript = transcript
        self._ready = asyncio.Event()
        if not inherits:
            self._ready.set()

    async def release_previous(self) -> None:
        """Release the claims a previous start of this replica left; call once the port is bound."""
        if self._ready.is_set():
            return
        try:
            released = await self._transcript.release_holder_claims(self.name)
            if released:
                logger.info("released a previous start's claims", extra={"holder": self.name, "claim_ids": released})
        except CompactionError as error:
            # Not fatal: whatever it held lapses when its lease ends.
            logger.warning("previous claims not released", extra={"holder": self.name, "reason": error.reason})
        finally:
            self._ready.set()

    async def ready(self) -> None:
        """Wait until claims may be taken under this name (a predecessor's are gone)."""
        await self._ready.wait()
