"""`create_app(settings)`: the gateway's Starlette application.

Middleware, outermost first: Starlette's server-error guard, `AccessLogMiddleware` (log line,
last-resort 500), Starlette's `CORSMiddleware` when origins are configured (outside authentication,
so a preflight needs no token and a 401 still carries the CORS headers a browser needs to read it),
`AuthMiddleware` (401 unless a known bearer token; on the Follow WebSocket also a bearer
subprotocol), `BodyLimitMiddleware` (413), `BodyTimeoutMiddleware` (408), then Starlette's exception
middleware with the handlers of `errors` (AIP-193 bodies for every expected failure). The Follow
WebSocket handles its own failures (`follow`) and logs its own lines; the HTTP-only middleware lets it
through.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import BaseRoute

from continuum_gateway import (
    capabilities,
    compaction,
    console,
    follow,
    follow_hub,
    health,
    merges,
    messages,
    openapi,
    outline,
    reference,
    sessions,
    turns,
    upstream,
)
from continuum_gateway.access_log import AccessLogMiddleware
from continuum_gateway.auth import Authenticator, AuthMiddleware
from continuum_gateway.body_limit import BodyLimitMiddleware
from continuum_gateway.body_timeout import BodyTimeoutMiddleware
from continuum_gateway.errors import exception_handlers
from continuum_gateway.outline import CAPABILITIES_HEADER
from continuum_gateway.proto_comments import ProtoComments
from continuum_gateway.routing import Resource
from continuum_gateway.settings import GatewaySettings

logger = logging.getLogger("continuum.gateway")


def create_app(settings: GatewaySettings) -> Starlette:
    """Build the app; upstream channels open when its lifespan starts and close when it ends."""
    tokens = settings.user_tokens()
    if not tokens:
        logger.warning("no users configured: every authenticated route will answer 401")
    if not settings.service_token.get_secret_value():
        logger.warning("no service token configured: the services will refuse every call")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, object]]:
        async with upstream.connect(settings) as upstreams:
            # Shared Follow streams keep recent frames for browsers switching over from their own
            # baseline; more than a browser's whole buffer would only end in its overflow.
            hubs = follow_hub.Hubs(
                recent_frames=settings.follow_buffer_frames, recent_chars=settings.follow_buffer_chars
            )
            try:
                yield {upstream.STATE_KEY: upstreams, follow_hub.STATE_KEY: hubs}
            finally:
                await hubs.close()

    routes: list[BaseRoute] = [
        *health.ROUTES,
        *capabilities.routes(settings),
        *sessions.ROUTES,
        *messages.ROUTES,
        *outline.ROUTES,
        *compaction.ROUTES,
        # Only a gateway with a merge service serves its routes (and advertises `merge-v2`).
        *(merges.ROUTES if settings.merge_address else []),
        *turns.routes(settings),
        *follow.routes(settings),
    ]
    api = openapi.ApiDocument(lambda: routes, ProtoComments.load())
    routes += [*openapi.routes(api), *reference.routes(api)]
    open_paths = [
        route.path
        for route in routes
        if isinstance(route, Resource) and all(o.public for o in route.operations.values())
    ]
    # The web console's page and files: static, holding no data, so open like the reference.
    console_files = console.load_files()
    routes += console.routes(console_files)
    open_paths += console.open_paths(console_files)
    return Starlette(
        routes=routes,
        middleware=[
            Middleware(AccessLogMiddleware),
            *_cors(settings),
            Middleware(
                AuthMiddleware,
                authenticator=Authenticator(tokens),
                open_paths=open_paths,
                subprotocol_paths=[follow.FOLLOW_PATH_PATTERN],
                subprotocols=[follow.FOLLOW_SUBPROTOCOL],
            ),
            Middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes),
            Middleware(BodyTimeoutMiddleware, timeout=settings.body_timeout_seconds),
        ],
        exception_handlers=exception_handlers(),
        lifespan=lifespan,
    )


def _cors(settings: GatewaySettings) -> list[Middleware]:
    """Cross-origin access for the configured browser origins only (none: no CORS headers at all)."""
    if not settings.allowed_origins:
        return []
    return [
        Middleware(
            CORSMiddleware,
            allow_origins=settings.allowed_origins,
            allow_methods=["GET", "POST", "PATCH", "DELETE"],
            allow_headers=["Authorization", "Content-Type", CAPABILITIES_HEADER],
            # Scripts may read these response headers too (the rest are CORS-safelisted).
            expose_headers=["Location", "WWW-Authenticate"],
            max_age=600,
        )
    ]
