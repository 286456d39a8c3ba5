"""Helpers shared by the gateway tests (importable as `gateway_testing`)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from pydantic import SecretStr
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from continuum_gateway.settings import GatewaySettings

SERVICE_TOKEN = "gateway-test-service-token"
ALICE_TOKEN = "alice-browser-token"
BOB_TOKEN = "bob-browser-token"
USERS = {ALICE_TOKEN: "alice", BOB_TOKEN: "bob"}


def gateway_settings(data_dir: Path, transcript_address: str, **overrides: object) -> GatewaySettings:
    """Settings of a test gateway: two users, the test service token, port 0.

    Compaction is an address where nothing listens unless `compaction_address` is given, so a
    developer's own compaction on the default port never answers a test.
    """
    values: dict[str, object] = {
        "data_dir": data_dir,
        "port": 0,
        "transcript_address": transcript_address,
        "compaction_address": unused_address(),
        "service_token": SecretStr(SERVICE_TOKEN),
        "users": {SecretStr(token): user for token, user in USERS.items()},
        "readiness_timeout_seconds": 2.0,
        "upstream_timeout_seconds": 10.0,
    }
    values.update(overrides)
    return GatewaySettings(**values)  # type: ignore[arg-type]


def bearer(token: str) -> dict[str, str]:
    """Request headers presenting `token`."""
    return {"Authorization": f"Bearer {token}"}


def unused_address() -> str:
    """host:port where nothing listens (a port the OS just handed out and took back)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"127.0.0.1:{port}"


@asynccontextmanager
async def serving(app: ASGIApp) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client for `app` in-process, with the app's lifespan run around it as a server would.

    httpx's ASGITransport sends no lifespan events, so this drives the ASGI lifespan protocol itself
    and hands the lifespan state to every request, as uvicorn does.
    """
    state: dict[str, Any] = {}
    to_app: asyncio.Queue[Message] = asyncio.Queue()
    from_app: asyncio.Queue[Message] = asyncio.Queue()
    lifespan_scope: Scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": state}

    async def run_lifespan() -> None:
        await app(lifespan_scope, to_app.get, from_app.put)

    task = asyncio.create_task(run_lifespan())
    await to_app.put({"type": "lifespan.startup"})
    started = await from_app.get()
    assert started["type"] == "lifespan.startup.complete", started

    async def with_state(scope: Scope, receive: Receive, send: Send) -> None:
        await app({**scope, "state": dict(state)}, receive, send)

    try:
        transport = httpx.ASGITransport(app=with_state)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway.test") as client:
            yield client
    finally:
        await to_app.put({"type": "lifespan.shutdown"})
        stopped = await from_app.get()
        await task
        assert stopped["type"] == "lifespan.shutdown.complete", stopped


def assert_error(response: httpx.Response, http_status: int, status: str, reason: str | None = None) -> dict[str, Any]:
    """Check an AIP-193 error response; return its `error` object."""
    assert response.status_code == http_status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert set(error) == {"code", "status", "message", "details"}, error
    assert (error["code"], error["status"]) == (http_status, status), error
    if reason is not None:
        infos = [d for d in error["details"] if d["@type"] == "type.googleapis.com/google.rpc.ErrorInfo"]
        assert [info["reason"] for info in infos] == [reason], error
    return error


def violations(error: dict[str, Any]) -> list[dict[str, str]]:
    """The BadRequest field violations of an AIP-193 `error` object (empty when there are none)."""
    for detail in error["details"]:
        if detail["@type"] == "type.googleapis.com/google.rpc.BadRequest":
            found: list[dict[str, str]] = detail["fieldViolations"]
            return found
    return []
