"""`continuum up` as a newcomer runs it: real processes, real ports, real HTTP, then Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from process_testing import alive, children_of, runs

pytestmark = pytest.mark.e2e

CONTINUUM = Path(sys.executable).parent / "continuum"
COMPONENTS = ("transcript", "compaction", "gateway")
START_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0


def wait_for(condition: Callable[[], bool], timeout: float, what: str, diagnostics: Callable[[], str]) -> None:
    """Poll `condition` until true; fail with `diagnostics()` (the supervisor's output and logs) otherwise."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}\n{diagnostics()}")
        time.sleep(0.1)


class Run:
    """A `continuum up` subprocess, its data dir and every child pid seen while it ran."""

    def __init__(self, tmp_path: Path) -> None:
        self.data_dir = tmp_path / "data"
        self.output = tmp_path / "continuum-up.out"
        # A newcomer's shell, minus any service configuration a developer may have exported.
        env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("TRANSCRIPT_", "COMPACTION_", "GATEWAY_"))
        }
        argv = [str(CONTINUUM), "up", "--data-dir", str(self.data_dir)]
        argv += [f"--{name}-port=0" for name in COMPONENTS]
        with open(self.output, "wb") as output:
            self.process = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=output, stderr=subprocess.STDOUT)
        self.child_pids: set[int] = set()

    def port(self, name: str) -> int | None:
        try:
            text = (self.data_dir / "run" / f"{name}.port").read_text().strip()
        except FileNotFoundError:
            return None
        return int(text) if text.isdigit() else None

    def remember_children(self) -> None:
        """Record the children from the pid files and from /proc (the supervisor removes its pid files on exit)."""
        for name in COMPONENTS:
            pid_file = self.data_dir / "run" / f"{name}.pid"
            if pid_file.exists():
                self.child_pids.add(int(pid_file.read_text()))
        if self.process.poll() is None:
            self.child_pids |= children_of(self.process.pid)

    def diagnostics(self) -> str:
        parts = [f"--- continuum up (exit {self.process.poll()}):\n{self.output.read_text(errors='replace')}"]
        for name in COMPONENTS:
            log = self.data_dir / "logs" / f"{name}.log"
            if log.exists():
                parts.append(f"--- {log}:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-30:]))
        return "\n".join(parts)

    def kill_leftovers(self) -> None:
        """SIGKILL the supervisor and any child that outlived it, so a failed run leaves nothing behind."""
        self.remember_children()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for pid in self.child_pids:
            # Children lead their own process groups; the cmdline check guards against a reused pid.
            if runs(pid, b"continuum_"):
                os.killpg(pid, signal.SIGKILL)


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Run]:
    started = Run(tmp_path)
    try:
        yield started
    finally:
        started.kill_leftovers()


def test_up_serves_sessions_messages_and_compaction_and_stops_on_ctrl_c(run: Run) -> None:
    def supervisor_running() -> None:
        if run.process.poll() is not None:
            pytest.fail(f"`continuum up` exited early\n{run.diagnostics()}")

    def port_files_written() -> bool:
        supervisor_running()
        return all(run.port(name) is not None for name in COMPONENTS)

    wait_for(port_files_written, START_TIMEOUT, "the port files", run.diagnostics)
    gateway = f"http://127.0.0.1:{run.port('gateway')}"
    with httpx.Client(base_url=gateway, timeout=10.0, trust_env=False) as client:

        def ready() -> bool:
            supervisor_running()
            try:
                return client.get("/readyz").status_code == httpx.codes.OK
            except httpx.TransportError:
                return False

        wait_for(ready, START_TIMEOUT, "GET /readyz 200", run.diagnostics)
        run.remember_children()
        dev_token_file = run.data_dir / "dev-token"
        assert dev_token_file.stat().st_mode & 0o777 == 0o600
        client.headers["Authorization"] = f"Bearer {dev_token_file.read_text().strip()}"

        created = client.post("/v1/sessions", json={"title": "e2e"})
        assert created.status_code == httpx.codes.CREATED, created.text
        assert created.json()["created"] is True
        session_id = created.json()["session"]["sessionId"]
        for text in ("first", "second"):
            appended = client.post(
                f"/v1/sessions/{session_id}/messages",
                json={"messages": [{"role": "MESSAGE_ROLE_USER", "content": [{"text": text}]}]},
            )
            assert appended.is_success, appended.text
        listed = client.get(f"/v1/sessions/{session_id}/messages", params={"after": 0})
        # The gateway reaches compaction, which reaches transcript for the session's owner.
        summary = client.get(f"/v1/sessions/{session_id}/compaction")
        compacted = client.post(f"/v1/sessions/{session_id}/compaction:compactNow")

    assert (summary.status_code, summary.json()) == (httpx.codes.OK, {"data": None}), summary.text
    assert compacted.status_code == httpx.codes.OK, compacted.text
    assert compacted.json()["state"] == "COMPACT_NOW_STATE_COMPLETED"

    assert listed.status_code == httpx.codes.OK, listed.text
    messages = listed.json()["messages"]
    assert [message["content"] for message in messages] == [[{"text": "first"}], [{"text": "second"}]]
    assert [message["role"] for message in messages] == ["MESSAGE_ROLE_USER"] * 2
    # int64 ids travel as JSON strings (proto3 JSON mapping).
    ids = [int(message["messageId"]) for message in messages]
    assert ids == sorted(ids)
    assert ids[0] < ids[1]

    assert len(run.child_pids) == len(COMPONENTS), run.diagnostics()
    run.process.send_signal(signal.SIGINT)
    try:
        code = run.process.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`continuum up` did not exit within {STOP_TIMEOUT} s of SIGINT\n{run.diagnostics()}")
    assert code == 0, run.diagnostics()
    assert not [pid for pid in run.child_pids if alive(pid)], run.diagnostics()
