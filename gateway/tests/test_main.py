"""`python -m continuum_gateway` as a supervisor runs it: port 0, port file, real HTTP, SIGINT."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from deadline_testing import wait_for
from gateway_testing import unused_address
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect
from websockets.typing import Subprotocol

from continuum_gateway.__main__ import uvicorn_config
from continuum_gateway.auth import bearer_subprotocol
from continuum_gateway.follow import FOLLOW_SUBPROTOCOL
from continuum_gateway.settings import GatewaySettings

DEV_TOKEN = "main-test-dev-token"
SERVICE_TOKEN = "main-test-service-token"


def test_serves_on_a_free_port_and_exits_0_on_sigint(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("GATEWAY_")}
    env.update(
        GATEWAY_PORT="0",
        GATEWAY_DATA_DIR=str(tmp_path),
        GATEWAY_TRANSCRIPT_ADDRESS=unused_address(),
        GATEWAY_SERVICE_TOKEN=SERVICE_TOKEN,
        GATEWAY_DEV_TOKEN=DEV_TOKEN,
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "continuum_gateway"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    port_file = tmp_path / "run" / "gateway.port"
    try:
        wait_for(lambda: port_file.exists() or process.poll() is not None, what="the gateway's port file", seconds=30)
        if process.poll() is not None:
            _, stderr = process.communicate()
            raise AssertionError(f"gateway exited with {process.returncode}: {stderr.decode(errors='replace')}")
        port = int(port_file.read_text())
        assert port > 0
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            healthz = client.get("/healthz")
            assert (healthz.status_code, healthz.json()) == (200, {"status": "ok"})
            # Past authentication, through the lifespan's upstreams, to the absent transcript.
            sessions = client.get("/v1/sessions", headers={"Authorization": f"Bearer {DEV_TOKEN}"})
            assert sessions.status_code == 503, sessions.text
        # The Follow WebSocket, authenticated the browser's way, reports the absent transcript.
        subprotocols = [Subprotocol(FOLLOW_SUBPROTOCOL), Subprotocol(bearer_subprotocol(DEV_TOKEN))]
        with connect(f"ws://127.0.0.1:{port}/v1/sessions/s1/follow", subprotocols=subprotocols) as websocket:
            websocket.send(json.dumps({"type": "hello", "capabilities": ["transcript-v2"]}))
            error = json.loads(websocket.recv(timeout=10))
            with pytest.raises(ConnectionClosed):
                websocket.recv(timeout=10)
        assert (error["type"], error["error"]["status"]) == ("error", "UNAVAILABLE")
        assert websocket.close_code == 4503
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, stderr.decode(errors="replace")
    assert not stdout
    lines = [json.loads(line) for line in stderr.decode().splitlines()]
    assert {"event": "gateway started", "port": port}.items() <= next(
        line for line in lines if line["event"] == "gateway started"
    ).items()
    assert any(line["event"] == "gateway stopped" for line in lines)
    assert DEV_TOKEN.encode() not in stderr
    assert bearer_subprotocol(DEV_TOKEN).encode() not in stderr
    follow = next(line for line in lines if line["event"] == "follow closed")
    assert (follow["user"], follow["outcome"], follow["close_code"]) == ("dev", "upstream_unavailable", 4503)
    assert SERVICE_TOKEN.encode() not in stderr
    assert [p.name for p in port_file.parent.iterdir()] == ["gateway.port"]


def test_uvicorn_pings_websockets_as_configured(tmp_path: Path) -> None:
    settings = GatewaySettings(
        data_dir=tmp_path, ws_ping_interval_seconds=7.5, ws_ping_timeout_seconds=3.0, ws_max_message_bytes=4096
    )
    config = uvicorn_config(settings)
    assert (config.ws, config.ws_ping_interval, config.ws_ping_timeout) == ("websockets-sansio", 7.5, 3.0)
    assert config.ws_max_size == 4096
    # Follow frames go out uncompressed: deflating small JSON texts costs more CPU than it saves.
    assert config.ws_per_message_deflate is False
