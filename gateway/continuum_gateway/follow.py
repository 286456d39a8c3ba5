"""Follow over WebSocket: a browser's live view of a session, relayed frame for frame from transcript.

    WS /v1/sessions/{session_id}/follow

Opening (a browser, which cannot set headers on a WebSocket)::

    const ws = new WebSocket(url, ["continuum.follow.v1", "continuum.bearer." + base64url(token)]);

The bearer subprotocol is the primary credential for browsers; other clients may send
``Authorization: Bearer <token>`` instead (see `continuum_gateway.auth`); tokens in the query string
are not accepted. A missing or unknown token gets an UNAUTHENTICATED error message (the 401 body)
and close code 4401. The gateway selects ``continuum.follow.v1`` when it is offered and never echoes
the credential.

Protocol, all messages JSON text:

1. The browser sends its hello first (within `follow_hello_timeout_seconds`)::

       {"type": "hello", "capabilities": ["transcript-v2", ...], "resume": {"streamGeneration": "3", "seq": "41"}}

   ``resume`` (optional) is the last applied cursor. A hello without ``transcript-v2`` is refused
   with an UPGRADE_REQUIRED error and close code 4426; there is no legacy fallback.
2. The gateway calls TranscriptService.Follow as the authenticated user and relays every frame as one
   message, in order::

       {"type": "<frame>", "streamGeneration": "3", "<frame>": {...}}

   where ``<frame>`` is the JSON (camelCase) name of the FollowResponse oneof field that is set
   (``handshake``, ``snapshotBegin``, ``snapshotRecords``, ..., ``batch``, ``chunk``, ``resync``) and
   its value that frame in proto JSON, like the REST routes (camelCase, int64 as strings, zero
   values present), so ``message[message.type]`` is the payload. A frame of a kind this gateway does
   not know is relayed as ``{"type": "unknown", "streamGeneration": ...}``; browsers ignore unknown types.
3. A ``resync`` frame from transcript is relayed and the socket closed normally (1000): the browser
   re-follows, with ``resume`` when the frame says ``resumable``.
4. A failure (the session is missing or another user's, a bad hello, transcript down) is one
   ``{"type": "error", "error": {...}}`` message carrying the same AIP-193 body as REST, then a close
   with `errors.close_code_for`: 4000 + the HTTP status (4400, 4403, 4404, 4426, 4503, ...).
5. A browser that cannot keep up (its socket does not drain and `follow_buffer_frames` frames, or
   `follow_buffer_chars` characters of them, pile up) gets, best effort, in place of the frames it
   could not take::

       {"type": "resync", "streamGeneration": "3", "resync": {"reason": "RESYNC_REASON_OVERFLOW", "resumable": true}}

   then close code 4429; the browser's share of the upstream stream is given up at once (the stream
   itself is cancelled when no other browser uses it). Other browsers are not affected.

Upstream streams are shared (`continuum_gateway.follow_hub`, unless
`GatewaySettings.follow_share_upstreams` is off): browsers of the same user following the same
session with the same capabilities get the suffix from one transcript Follow call, each frame
converted to JSON once for all of them. Each browser still gets a baseline of its own first (the
first browser from the shared call, a later one from a call of its own, which is also transcript
authorizing it) and switches over at a frame both streams relayed; what it receives is exactly what
its own stream would have relayed. A browser that resumes keeps a call of its own.

Messages the browser sends after its hello are ignored. uvicorn pings every socket (see
`GatewaySettings.ws_ping_interval_seconds`). However the socket ends, the browser's own upstream
Follow call (if it still has one) is cancelled with it, and a shared one once its last browser is
gone. Logs carry the user, session, outcome, close code, frame count and whether the stream was
shared, never frame contents or the token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import json_format
from starlette.routing import WebSocketRoute, compile_path
from starlette.websockets import WebSocket, WebSocketDisconnect

from continuum.transcript.v1 import transcript_service_pb2
from continuum_gateway.auth import acting_user
from continuum_gateway.errors import (
    UPGRADE_REQUIRED,
    GatewayError,
    UpstreamError,
    body_close_code,
    internal_error_body,
    upstream_error_body,
    websocket_error_message,
)
from continuum_gateway.field_paths import json_path
from continuum_gateway.follow_hub import (
    STATE_KEY,
    AlignKey,
    Close,
    Hub,
    Hubs,
    Outbox,
    alignment_key,
    frame_message,
)
from continuum_gateway.protojson import refused_field
from continuum_gateway.settings import GatewaySettings
from continuum_gateway.upstream import TRANSCRIPT, Upstreams, upstreams_of
from continuum_runtime.wire_names import TRANSCRIPT_V2

logger = logging.getLogger("continuum.gateway.follow")

FOLLOW_PATH = "/v1/sessions/{session_id}/follow"
# Where `AuthMiddleware` accepts the bearer subprotocol.
FOLLOW_PATH_PATTERN = compile_path(FOLLOW_PATH)[0]
# The subprotocol a browser offers beside its credential, and the one the gateway selects.
FOLLOW_SUBPROTOCOL = "continuum.follow.v1"
# Bounds of the hello: a capability list is a handful of short names.
MAX_CAPABILITIES = 32
MAX_CAPABILITY_LENGTH = 64
_HELLO_FIELDS = frozenset({"type", "capabilities", "resume"})


@dataclass(frozen=True)
class FollowOptions:
    """The settings one Follow socket runs with."""

    buffer_frames: int
    buffer_chars: int
    hello_timeout: float
    close_timeout: float
    share_upstreams: bool

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> FollowOptions:
        """The Follow part of the gateway's settings."""
        return cls(
            buffer_frames=settings.follow_buffer_frames,
            buffer_chars=settings.follow_buffer_chars,
            hello_timeout=settings.follow_hello_timeout_seconds,
            close_timeout=settings.follow_close_timeout_seconds,
            share_upstreams=settings.follow_share_upstreams,
        )


def parse_hello(text: str, session_id: str) -> transcript_service_pb2.FollowRequest:
    """The Follow request a hello asks for; malformed or legacy hellos raise `GatewayError`."""
    try:
        hello = json.loads(text)
    except (ValueError, RecursionError):
        raise GatewayError.invalid_argument("hello", "not valid JSON", reason="INVALID_HELLO") from None
    if not isinstance(hello, dict) or hello.get("type") != "hello":
        raise GatewayError.invalid_argument(
            "type", 'the first message must be {"type": "hello", ...}', reason="INVALID_HELLO"
        )
    unknown = sorted(str(key) for key in set(hello) - _HELLO_FIELDS)
    if unknown:
        raise GatewayError.invalid_argument(unknown[0], "unknown hello field", reason="INVALID_HELLO")
    capabilities = hello.get("capabilities", [])
    if (
        not isinstance(capabilities, list)
        or len(capabilities) > MAX_CAPABILITIES
        or not all(isinstance(c, str) and 0 < len(c) <= MAX_CAPABILITY_LENGTH for c in capabilities)
    ):
        raise GatewayError.invalid_argument(
            "capabilities",
            f"must be a list of at most {MAX_CAPABILITIES} names of 1-{MAX_CAPABILITY_LENGTH} characters",
            reason="INVALID_HELLO",
        )
    if TRANSCRIPT_V2 not in capabilities:
        raise GatewayError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"this gateway follows sessions with {TRANSCRIPT_V2} only; upgrade the client",
            reason=UPGRADE_REQUIRED,
            metadata={"required": TRANSCRIPT_V2},
        )
    request = transcript_service_pb2.FollowRequest(
        session_id=session_id, capabilities=list(dict.fromkeys(capabilities))
    )
    resume = hello.get("resume")
    if resume is not None:
        if not isinstance(resume, dict):
            raise GatewayError.invalid_argument("resume", "must be {streamGeneration, seq}", reason="INVALID_HELLO")
        try:
            json_format.ParseDict(resume, request.resume)
        except json_format.ParseError:
            # Named and described as REST refusals are (never the parser's own words).
            violation = refused_field(resume, request.resume.DESCRIPTOR, "resume")
            raise GatewayError.invalid_argument(
                violation.field, violation.description, reason="INVALID_HELLO"
            ) from None
        # Cursors count up from 0; REST refuses a negative one too (e.g. messages:page's pin).
        for field in request.resume.DESCRIPTOR.fields:
            value = getattr(request.resume, field.name)
            if isinstance(value, int) and value < 0:
                raise GatewayError.invalid_argument(
                    f"resume.{field.json_name}", "must not be negative", reason="INVALID_HELLO"
                )
    return request


def _hello_field(path: str) -> str:
    """A field transcript names in a Follow refusal, as the browser spelled it: the path's session id
    by its route name, the rest as the hello's JSON (``resume.streamGeneration``)."""
    if path == "session_id":
        return path
    return json_path(path, transcript_service_pb2.FollowRequest.DESCRIPTOR)


@dataclass(frozen=True)
class _Upstream:
    """The Follow call to make: on which upstreams, asking what, for whom, shared through which hubs."""

    upstreams: Upstreams
    request: transcript_service_pb2.FollowRequest
    user: str
    # None: every browser on its own upstream call (`GatewaySettings.follow_share_upstreams` off).
    hubs: Hubs | None


class _Relay:
    """One browser's Follow: upstream frames into its bounded outbox, the outbox onto the socket.

    Three tasks: the feeder fills the outbox (from a hub, or from the browser's own upstream call
    until it can switch to one, see `follow_hub`), the sender writes to the socket (and blocks while
    the browser does not read), the watcher notices the browser leaving. Whichever ends first decides
    how the rest end. The browser's own upstream call lives exactly as long as its reader: it is
    cancelled the moment the reader stops (stream over, browser gone or too slow, switched to a hub);
    its place on a hub is given up the same way.
    """

    def __init__(self, websocket: WebSocket, upstream: _Upstream, options: FollowOptions) -> None:
        self.websocket = websocket
        self.upstream = upstream
        self.options = options
        self.outbox = Outbox(options.buffer_frames, options.buffer_chars)
        self.hub: Hub | None = None
        self.frames_sent = 0
        self.close_code: int | None = None
        # The browser did not take the last frames and the close in time.
        self.undelivered = False

    @property
    def outcome(self) -> str:
        """How the stream ended, for the log."""
        return self.outbox.outcome + ("_undelivered" if self.undelivered else "")

    @property
    def shared(self) -> bool:
        """Whether a hub fed the browser in the end."""
        return self.outbox.attached.is_set()

    async def run(self) -> None:
        """Relay until the stream ends, the browser leaves or falls behind; cancel what is left."""
        feeder = asyncio.create_task(self._feed(), name="follow-upstream")
        sender = asyncio.create_task(self._send_to_browser(), name="follow-send")
        watcher = asyncio.create_task(self._watch_browser(), name="follow-watch")
        tasks = {feeder, sender, watcher}
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if done == {feeder}:
                # The upstream part is over (end, error or overflow): give the browser a bounded
                # time for the last frames and the close, unless it leaves first.
                await asyncio.wait(
                    {sender, watcher}, timeout=self.options.close_timeout, return_when=asyncio.FIRST_COMPLETED
                )
                if not sender.done():
                    self.undelivered = True
        finally:
            for task in tasks:
                task.cancel()
            self.outbox.abandon()
            if self.hub is not None:
                self.hub.leave(self.outbox)
            results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, Exception) and not isinstance(result, WebSocketDisconnect):
                logger.error("follow relay failed", exc_info=result)

    async def _feed(self) -> None:
        try:
            await self._feed_outbox()
        except Exception:
            # The formatter records the exception type only: messages could quote content.
            logger.exception("follow relay failed")
            self.outbox.fail(internal_error_body(), "internal_error")

    async def _feed_outbox(self) -> None:
        """Until the outbox holds its close: from a hub, or first (or only) from a call of its own."""
        upstream = self.upstream
        if upstream.hubs is None or upstream.request.HasField("resume"):
            await self._read_own_call()
            return
        self.hub, created = upstream.hubs.join(upstream.upstreams, upstream.request, upstream.user, self.outbox)
        if not created:
            reader = asyncio.create_task(self._read_own_call(), name="follow-baseline")
            attached = asyncio.create_task(self.outbox.attached.wait(), name="follow-attached")
            try:
                await asyncio.wait({reader, attached}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                reader.cancel()
                attached.cancel()
                failure, _ = await asyncio.gather(reader, attached, return_exceptions=True)
            if isinstance(failure, Exception):
                raise failure
            if not self.outbox.attached.is_set():
                return  # the browser's own stream ended it
        await self.outbox.ended.wait()

    async def _read_own_call(self) -> None:
        """The browser's own upstream call into its outbox, until it ends or the browser switches to
        the hub (`self.hub`; None: never)."""
        upstream, outbox = self.upstream, self.outbox
        live = False
        async with upstream.upstreams.follow_transcript(upstream.request, user=upstream.user) as call:
            try:
                async for frame in call:
                    if outbox.attached.is_set():
                        return
                    kind = frame.WhichOneof("frame")
                    if not outbox.deliver(frame_message(frame, kind), frame.stream_generation, kind):
                        return  # overflow: the outbox holds the resync and the close
                    if not live:
                        live = kind == "snapshot_end"
                    elif kind != "heartbeat" and self._switched(alignment_key(frame, kind)):
                        return
            except grpc.aio.AioRpcError as error:
                if not outbox.attached.is_set():
                    body = upstream_error_body(UpstreamError(TRANSCRIPT, error, _hello_field))
                    outbox.fail(body, f"upstream_{error.code().name.lower()}")
                return
        if not outbox.attached.is_set():
            outbox.end()

    def _switched(self, key: AlignKey | None) -> bool:
        """Offer the hub the suffix frame just relayed; True once the hub feeds the browser."""
        hub = self.hub
        if hub is None:
            return False
        if hub.over and self.upstream.hubs is not None:
            # The hub ended (its stream's resync or error reached its browsers); a newer one may run.
            successor = self.upstream.hubs.find(hub.key)
            if successor is None:
                return False
            hub.leave(self.outbox)
            self.hub = hub = successor
        return hub.align(self.outbox, key)

    async def _send_to_browser(self) -> None:
        while True:
            item = await self.outbox.next()
            if isinstance(item, Close):
                await self.websocket.close(item.code)
                self.close_code = item.code
                return
            await self.websocket.send_text(item)
            self.frames_sent += 1

    async def _watch_browser(self) -> None:
        while True:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            # Anything the browser sends after its hello is ignored (and never logged).


def hubs_of(websocket: WebSocket) -> Hubs:
    """The `Hubs` the lifespan put in the socket's state."""
    hubs = getattr(websocket.state, STATE_KEY, None)
    if not isinstance(hubs, Hubs):
        raise RuntimeError("the gateway's lifespan did not run: no follow hubs in the socket state")
    return hubs


async def _receive_text(websocket: WebSocket) -> str:
    message = await websocket.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(int(message.get("code", 1000)))
    text = message.get("text")
    if text is None:
        raise GatewayError.invalid_argument("hello", "must be a text message", reason="INVALID_HELLO")
    return str(text)


async def _refuse(websocket: WebSocket, body: dict[str, Any], grace: float) -> int:
    """Send an error message and close with its code, giving up on a browser that does not read."""
    code = body_close_code(body)
    # RuntimeError: the socket was already closed (only after an unexpected failure mid-relay).
    with contextlib.suppress(WebSocketDisconnect, TimeoutError, RuntimeError):
        async with asyncio.timeout(grace):
            await websocket.send_text(websocket_error_message(body))
            await websocket.close(code)
    return code


async def follow(websocket: WebSocket, options: FollowOptions) -> None:
    """Serve one Follow socket (authenticated by `AuthMiddleware`) from hello to close."""
    user = acting_user(websocket)
    session_id = str(websocket.path_params["session_id"])
    fields: dict[str, Any] = {"user": user, "session_id": session_id, "route": FOLLOW_PATH}
    offered = websocket.scope.get("subprotocols", [])
    started = time.perf_counter()
    outcome, code, frames, shared = "browser_closed", None, 0, False
    try:
        await websocket.accept(subprotocol=FOLLOW_SUBPROTOCOL if FOLLOW_SUBPROTOCOL in offered else None)
        try:
            async with asyncio.timeout(options.hello_timeout):
                text = await _receive_text(websocket)
        except TimeoutError:
            raise GatewayError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no hello within {options.hello_timeout:g} s",
                reason="HELLO_TIMEOUT",
            ) from None
        request = parse_hello(text, session_id)
        logger.info("follow opened", extra={**fields, "resume": request.HasField("resume")})
        hubs = hubs_of(websocket) if options.share_upstreams else None
        relay = _Relay(websocket, _Upstream(upstreams_of(websocket), request, user, hubs), options)
        await relay.run()
        outcome, code, frames, shared = relay.outcome, relay.close_code, relay.frames_sent, relay.shared
    except WebSocketDisconnect:
        pass
    except GatewayError as error:
        outcome = f"refused_{error.reason.lower()}"
        code = await _refuse(websocket, error.body(), options.close_timeout)
    except Exception:
        logger.exception("follow failed", extra=fields)
        outcome = "internal_error"
        code = await _refuse(websocket, internal_error_body(), options.close_timeout)
    finally:
        duration_ms = round((time.perf_counter() - started) * 1000, 1)
        logger.info(
            "follow closed",
            extra={
                **fields,
                "outcome": outcome,
                "close_code": code,
                "frames": frames,
                "shared": shared,
                "duration_ms": duration_ms,
            },
        )


def routes(settings: GatewaySettings) -> list[WebSocketRoute]:
    """The Follow WebSocket route, bound to the settings' Follow options."""
    options = FollowOptions.from_settings(settings)

    async def endpoint(websocket: WebSocket) -> None:
        await follow(websocket, options)

    return [WebSocketRoute(FOLLOW_PATH, endpoint, name="follow")]
