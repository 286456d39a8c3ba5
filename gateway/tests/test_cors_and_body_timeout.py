"""Browser origins the deployment allows (CORS), and request bodies that stop arriving (408)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from gateway_testing import ALICE_TOKEN, assert_error, bearer, gateway_settings, serving, unused_address
from gateway_ws_testing import live_gateway
from pydantic import ValidationError

from continuum_gateway.app import create_app
from continuum_gateway.settings import GatewaySettings

CONSOLE = "https://console.example.com"
PREFLIGHT = {
    "Origin": CONSOLE,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


@pytest.fixture
async def cors_gateway(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    """A gateway that allows the console's origin (its upstreams are absent)."""
    settings = gateway_settings(tmp_path, unused_address(), allowed_origins=[CONSOLE, "http://localhost:5173"])
    async with serving(create_app(settings)) as client:
        yield client


async def test_a_preflight_from_an_allowed_origin_needs_no_token(cors_gateway: httpx.AsyncClient) -> None:
    response = await cors_gateway.options("/v1/sessions", headers=PREFLIGHT)
    assert response.status_code == 200, response.text
    assert response.headers["access-control-allow-origin"] == CONSOLE
    assert "POST" in response.headers["access-control-allow-methods"]
    allowed_headers = response.headers["access-control-allow-headers"].lower()
    assert "authorization" in allowed_headers
    assert "content-type" in allowed_headers


async def test_answers_to_an_allowed_origin_carry_cors_headers_even_when_refused(
    cors_gateway: httpx.AsyncClient,
) -> None:
    # A browser script can only read a 401 (and so tell a bad token) when it carries the header too.
    refused = await cors_gateway.get("/v1/sessions", headers={"Origin": CONSOLE})
    assert_error(refused, 401, "UNAUTHENTICATED")
    assert refused.headers["access-control-allow-origin"] == CONSOLE
    created = await cors_gateway.post(
        "/v1/sessions", headers={"Origin": CONSOLE, **bearer(ALICE_TOKEN)}, json={"title": "t"}
    )
    assert created.headers["access-control-allow-origin"] == CONSOLE
    assert "location" in created.headers["access-control-expose-headers"].lower()


async def test_other_origins_get_no_cors_headers(cors_gateway: httpx.AsyncClient) -> None:
    preflight = await cors_gateway.options("/v1/sessions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
    assert preflight.status_code == 400
    assert "access-control-allow-origin" not in preflight.headers
    response = await cors_gateway.get(
        "/v1/capabilities", headers={"Origin": "https://evil.example", **bearer(ALICE_TOKEN)}
    )
    assert response.status_code == 200, response.text
    assert "access-control-allow-origin" not in response.headers


async def test_no_origin_is_allowed_by_default(tmp_path: Path) -> None:
    async with serving(create_app(gateway_settings(tmp_path, unused_address()))) as gateway:
        preflight = await gateway.options("/v1/sessions", headers=PREFLIGHT)
        response = await gateway.get("/v1/capabilities", headers={"Origin": CONSOLE, **bearer(ALICE_TOKEN)})
    assert "access-control-allow-origin" not in preflight.headers
    assert "access-control-allow-origin" not in response.headers


def test_allowed_origins_are_read_as_a_list_or_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_ALLOWED_ORIGINS", f"{CONSOLE}, http://localhost:5173")
    assert GatewaySettings(data_dir=tmp_path).allowed_origins == [CONSOLE, "http://localhost:5173"]
    monkeypatch.setenv("GATEWAY_ALLOWED_ORIGINS", json.dumps([CONSOLE]))
    assert GatewaySettings(data_dir=tmp_path).allowed_origins == [CONSOLE]
    monkeypatch.setenv("GATEWAY_ALLOWED_ORIGINS", "")
    assert GatewaySettings(data_dir=tmp_path).allowed_origins == []
    # An origin has no path: "https://host/" would never match what a browser sends.
    monkeypatch.setenv("GATEWAY_ALLOWED_ORIGINS", f"{CONSOLE}/")
    with pytest.raises(ValidationError, match="is not an origin"):
        GatewaySettings(data_dir=tmp_path)


async def test_a_stalled_body_is_cut_off_with_408(tmp_path: Path) -> None:
    async with live_gateway(tmp_path, int(unused_address().rsplit(":", 1)[1]), body_timeout_seconds=0.5) as gateway:
        reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
        try:
            # Promise 100 bytes, send 10, then nothing.
            writer.write(
                b"POST /v1/sessions HTTP/1.1\r\nHost: gateway\r\n"
                + f"Authorization: Bearer {ALICE_TOKEN}\r\n".encode()
                + b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"title": '
            )
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=30)
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            body = await asyncio.wait_for(reader.readexactly(length), timeout=30)
        finally:
            writer.close()
    assert head.startswith(b"HTTP/1.1 408 "), head
    error = json.loads(body)["error"]
    assert (error["code"], error["status"]) == (408, "DEADLINE_EXCEEDED")
    assert error["details"][0]["reason"] == "REQUEST_TIMEOUT"
    assert error["details"][0]["domain"] == "gateway.continuum"


async def test_a_stalled_body_is_408_in_process_too(tmp_path: Path) -> None:
    settings = gateway_settings(tmp_path, unused_address(), body_timeout_seconds=0.2)
    never = asyncio.Event()

    async def stalling() -> AsyncIterator[bytes]:
        yield b'{"title": '
        await never.wait()

    async with serving(create_app(settings)) as gateway:
        response = await gateway.post("/v1/sessions", headers=bearer(ALICE_TOKEN), content=stalling())
    assert_error(response, 408, "DEADLINE_EXCEEDED", "REQUEST_TIMEOUT")
