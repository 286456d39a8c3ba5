"""The gateway's connections to the services: one grpc.aio channel each, opened at start-up.

`connect(settings)` is entered by the app's lifespan, which hands the `Upstreams` to requests through
the lifespan state; nothing here is a module-level client. Calls made for a browser request carry the
service credential and the acting user, so the service (not the gateway) decides ownership.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from starlette.requests import HTTPConnection, Request

from continuum.agent.v1 import agent_service_pb2, agent_service_pb2_grpc
from continuum.compaction.v1 import compaction_service_pb2, compaction_service_pb2_grpc
from continuum.merge.v1 import merge_service_pb2, merge_service_pb2_grpc
from continuum.transcript.v1 import transcript_service_pb2, transcript_service_pb2_grpc
from continuum_gateway.auth import acting_user
from continuum_gateway.errors import UpstreamError
from continuum_gateway.settings import GatewaySettings
from continuum_runtime.auth import call_metadata
from continuum_runtime.channels import open_channel

logger = logging.getLogger("continuum.gateway")

TRANSCRIPT = "transcript"
TRANSCRIPT_SERVICE = transcript_service_pb2.DESCRIPTOR.services_by_name["TranscriptService"].full_name
COMPACTION = "compaction"
COMPACTION_SERVICE = compaction_service_pb2.DESCRIPTOR.services_by_name["CompactionService"].full_name
MERGE = "merge"
MERGE_SERVICE = merge_service_pb2.DESCRIPTOR.services_by_name["MergeService"].full_name
AGENT = "agent"
AGENT_SERVICE = agent_service_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name
# Every upstream readiness can name (merge and the agent only when their addresses are set).
UPSTREAM_NAMES = (TRANSCRIPT, COMPACTION, MERGE, AGENT)
# Key of the lifespan state entry holding the `Upstreams`.
STATE_KEY = "upstreams"
# The health service's name for a ready upstream.
SERVING = "SERVING"


class Upstreams:
    """Stubs of every service the gateway calls, over channels it owns (merge only when configured)."""

    def __init__(self, settings: GatewaySettings) -> None:
        self._transcript_channel = open_channel(settings.transcript_address, settings.grpc_max_message_bytes)
        self.transcript = transcript_service_pb2_grpc.TranscriptServiceStub(self._transcript_channel)
        self._transcript_health = health_pb2_grpc.HealthStub(self._transcript_channel)
        self._compaction_channel = open_channel(settings.compaction_address, settings.grpc_max_message_bytes)
        self.compaction = compaction_service_pb2_grpc.CompactionServiceStub(self._compaction_channel)
        self._compaction_health = health_pb2_grpc.HealthStub(self._compaction_channel)
        self._merge_channel = (
            open_channel(settings.merge_address, settings.grpc_max_message_bytes) if settings.merge_address else None
        )
        self.merge = (
            merge_service_pb2_grpc.MergeServiceStub(self._merge_channel) if self._merge_channel is not None else None
        )
        self._merge_health = (
            health_pb2_grpc.HealthStub(self._merge_channel) if self._merge_channel is not None else None
        )
        # The reference agent runtime is optional: without its address there is no channel to it.
        self._agent_channel = (
            open_channel(settings.agent_address, settings.grpc_max_message_bytes) if settings.agent_address else None
        )
        self.agent = agent_service_pb2_grpc.AgentServiceStub(self._agent_channel) if self._agent_channel else None
        self._agent_health = health_pb2_grpc.HealthStub(self._agent_channel) if self._agent_channel else None
        self._service_token = settings.service_token
        self._timeout = settings.upstream_timeout_seconds
        self._readiness_timeout = settings.readiness_timeout_seconds
        self._open_follows = 0

    @property
    def open_follows(self) -> int:
        """Transcript Follow streams open right now (one per connected follower)."""
        return self._open_follows

    async def call_transcript(self, rpc: Callable[..., Awaitable[Any]], request: Message, *, user: str) -> Any:
        """Call a transcript RPC (e.g. ``upstreams.transcript.GetSession``) on behalf of `user`.

        A failed call raises `UpstreamError`, which the app turns into the matching HTTP error.
        """
        return await self._call(TRANSCRIPT, rpc, request, user)

    async def call_compaction(self, rpc: Callable[..., Awaitable[Any]], request: Message, *, user: str) -> Any:
        """Call a compaction RPC (e.g. ``upstreams.compaction.CompactNow``) on behalf of `user`.

        A failed call raises `UpstreamError`, which the app turns into the matching HTTP error.
        """
        return await self._call(COMPACTION, rpc, request, user)

    async def call_merge(self, rpc: Callable[..., Awaitable[Any]], request: Message, *, user: str) -> Any:
        """Call a merge RPC (e.g. ``upstreams.merge.StartMerge``) on behalf of `user`.

        A failed call raises `UpstreamError`, which the app turns into the matching HTTP error.
        """
        return await self._call(MERGE, rpc, request, user)

    async def call_agent(self, rpc: Callable[..., Awaitable[Any]], request: Message, *, user: str) -> Any:
        """Call an agent RPC (e.g. ``upstreams.agent.StartTurn``) on behalf of `user`.

        A failed call raises `UpstreamError`, which the app turns into the matching HTTP error.
        """
        return await self._call(AGENT, rpc, request, user)

    async def _call(self, upstream: str, rpc: Callable[..., Awaitable[Any]], request: Message, user: str) -> Any:
        metadata = call_metadata(self._service_token.get_secret_value(), user)
        try:
            return await rpc(request, metadata=metadata, timeout=self._timeout)
        except grpc.aio.AioRpcError as error:
            raise UpstreamError(upstream, error) from None

    @asynccontextmanager
    async def stream_transcript(self, rpc: Callable[..., Any], request: Message, *, user: str) -> AsyncIterator[Any]:
        """A server-streaming transcript call (e.g. ``upstreams.transcript.StreamMessage``) for `user`,
        under the upstream deadline and cancelled on exit. Reading it raises `UpstreamError`."""
        metadata = call_metadata(self._service_token.get_secret_value(), user)
        call = rpc(request, metadata=metadata, timeout=self._timeout)
        try:
            yield _Reading(call)
        finally:
            call.cancel()

    @asynccontextmanager
    async def follow_transcript(
        self, request: transcript_service_pb2.FollowRequest, *, user: str
    ) -> AsyncIterator[Any]:
        """A transcript Follow stream for `user` (a grpc.aio call to iterate), cancelled on exit.

        The stream has no deadline: it lives as long as the follower. Leaving the block cancels the
        call whatever the reason (the browser left, it fell behind, the gateway stops), so no stream
        outlives its WebSocket. Iterating a failed call raises `grpc.aio.AioRpcError`.
        """
        metadata = call_metadata(self._service_token.get_secret_value(), user)
        call = self.transcript.Follow(request, metadata=metadata)
        self._open_follows += 1
        try:
            yield call
        finally:
            call.cancel()
            self._open_follows -= 1

    async def readiness(self) -> dict[str, str]:
        """Each upstream's serving status per the standard gRPC health service.

        Values are the health service's names ("SERVING", "NOT_SERVING", ...), or the gRPC code name
        of the failed check (e.g. "UNAVAILABLE" when nothing listens, "DEADLINE_EXCEEDED" when the
        check takes longer than the readiness timeout). The upstreams are checked concurrently, so
        the answer takes at most one readiness timeout. Merge is one of them only when configured.
        """
        checks = {
            TRANSCRIPT: self._check(self._transcript_health, TRANSCRIPT_SERVICE),
            COMPACTION: self._check(self._compaction_health, COMPACTION_SERVICE),
        }
        if self._merge_health is not None:
            checks[MERGE] = self._check(self._merge_health, MERGE_SERVICE)
        if self._agent_health is not None:
            checks[AGENT] = self._check(self._agent_health, AGENT_SERVICE)
        statuses = await asyncio.gather(*checks.values())
        return dict(zip(checks, statuses, strict=True))

    async def _check(self, stub: health_pb2_grpc.HealthStub, service: str) -> str:
        request = health_pb2.HealthCheckRequest(service=service)
        try:
            response = await stub.Check(request, timeout=self._readiness_timeout)
            return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))
        except grpc.aio.AioRpcError as error:
            return str(error.code().name)

    async def close(self) -> None:
        """Close every channel; calls still in flight are cancelled."""
        await self._transcript_channel.close()
        await self._compaction_channel.close()
        if self._merge_channel is not None:
            await self._merge_channel.close()
        if self._agent_channel is not None:
            await self._agent_channel.close()


@asynccontextmanager
async def connect(settings: GatewaySettings) -> AsyncIterator[Upstreams]:
    """Open the channels for the app's lifetime. Channels connect lazily, so a service that is down
    at start-up does not stop the gateway; /readyz reports it instead."""
    upstreams = Upstreams(settings)
    logger.info(
        "upstreams configured",
        extra={
            TRANSCRIPT: settings.transcript_address,
            COMPACTION: settings.compaction_address,
            MERGE: settings.merge_address or "not configured",
            AGENT: settings.agent_address or None,
        },
    )
    try:
        yield upstreams
    finally:
        await upstreams.close()


class _Reading:
    """Frames of a streaming call, its failures as `UpstreamError` (None once the stream ended)."""

    def __init__(self, call: Any) -> None:
        self._call = call

    async def read(self) -> Any:
        """The next frame, or None at the end of the stream."""
        try:
            frame = await self._call.read()
        except grpc.aio.AioRpcError as error:
            raise UpstreamError(TRANSCRIPT, error) from None
        return None if frame is grpc.aio.EOF else frame


def upstreams_of(request: HTTPConnection) -> Upstreams:
    """The `Upstreams` the lifespan put in the request's (or WebSocket's) state."""
    upstreams = getattr(request.state, STATE_KEY, None)
    if not isinstance(upstreams, Upstreams):
        raise RuntimeError("the gateway's lifespan did not run: no upstreams in the request state")
    return upstreams


TranscriptRpc = Callable[[transcript_service_pb2_grpc.TranscriptServiceStub], Callable[..., Awaitable[Any]]]


async def call_transcript(request: Request, select: TranscriptRpc, message: Message) -> Any:
    """Call the transcript RPC `select` picks (e.g. ``lambda t: t.GetSession``) for the request's user."""
    upstreams = upstreams_of(request)
    return await upstreams.call_transcript(select(upstreams.transcript), message, user=acting_user(request))


CompactionRpc = Callable[[compaction_service_pb2_grpc.CompactionServiceStub], Callable[..., Awaitable[Any]]]


async def call_compaction(request: Request, select: CompactionRpc, message: Message) -> Any:
    """Call the compaction RPC `select` picks (e.g. ``lambda c: c.CompactNow``) for the request's user."""
    upstreams = upstreams_of(request)
    return await upstreams.call_compaction(select(upstreams.compaction), message, user=acting_user(request))


MergeRpc = Callable[[merge_service_pb2_grpc.MergeServiceStub], Callable[..., Awaitable[Any]]]


async def call_merge(request: Request, select: MergeRpc, message: Message) -> Any:
    """Call the merge RPC `select` picks (e.g. ``lambda m: m.StartMerge``) for the request's user.

    Only the merge routes call it, and the app has them only when a merge address is configured.
    """
    upstreams = upstreams_of(request)
    if upstreams.merge is None:
        raise RuntimeError("merge routes are served without a merge address")
    return await upstreams.call_merge(select(upstreams.merge), message, user=acting_user(request))


AgentRpc = Callable[[agent_service_pb2_grpc.AgentServiceStub], Callable[..., Awaitable[Any]]]


async def call_agent(request: Request, select: AgentRpc, message: Message) -> Any:
    """Call the agent RPC `select` picks (e.g. ``lambda a: a.StartTurn``) for the request's user."""
    upstreams = upstreams_of(request)
    if upstreams.agent is None:
        raise RuntimeError("the turn routes are served only when GATEWAY_AGENT_ADDRESS is set")
    return await upstreams.call_agent(select(upstreams.agent), message, user=acting_user(request))
