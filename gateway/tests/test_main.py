"""`python -m continuum_gateway` as a supervisor runs it: port 0, port file, real HTTP, SIGINT."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from gateway_testing import unused_address

DEV_TOKEN = "main-test-dev-token"
SERVICE_TOKEN = "main-test-service-token"


def _wait_for(path: Path, process: subprocess.Popen[bytes], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if process.poll() is not None:
            _, stderr = process.communicate()
            raise AssertionError(f"gateway exited with {process.returncode}: {stderr.decode(errors='replace')}")
        assert time.monotonic() < deadline, f"{path} did not appear within {seconds} s"
        time.sleep(0.05)


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
        _wait_for(port_file, process, seconds=30)
        port = int(port_file.read_text())
        assert port > 0
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            healthz = client.get("/healthz")
            assert (healthz.status_code, healthz.json()) == (200, {"status": "ok"})
            # Past authentication, through the lifespan's upstreams, to the absent transcript.
            sessions = client.get("/v1/sessions", headers={"Authorization": f"Bearer {DEV_TOKEN}"})
            assert sessions.status_code == 503, sessions.text
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
    assert SERVICE_TOKEN.encode() not in stderr
    assert [p.name for p in port_file.parent.iterdir()] == ["gateway.port"]
