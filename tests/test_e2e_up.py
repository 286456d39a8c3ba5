"""`continuum up` as a newcomer runs it: real processes, real ports, real HTTP, then Ctrl-C; and the
operator's `continuum follow` and `cleanup` against what it started, finding its tokens on their own."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from deadline_testing import wait_for
from process_testing import alive, children_of, runs

from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum.transcript.v1 import transcript_service_pb2_grpc as api_grpc
from continuum_runtime.auth import call_metadata

pytestmark = pytest.mark.e2e

CONTINUUM = Path(sys.executable).parent / "continuum"
COMPONENTS = ("transcript", "compaction", "agent", "merge", "handoff-read", "gateway")
START_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0
COMMAND_TIMEOUT = 60.0


def newcomer_env() -> dict[str, str]:
    """A newcomer's shell, minus any Continuum configuration or token a developer may have exported."""
    return {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("TRANSCRIPT_", "COMPACTION_", "MERGE_", "AGENT_", "GATEWAY_", "CONTINUUM_"))
    }


class Run:
    """A `continuum up` subprocess, its data dir and every child pid seen while it ran."""

    def __init__(self, tmp_path: Path) -> None:
        # The checkout directory of `make run`: the data dir is the default ./.continuum.
        self.checkout = tmp_path
        self.data_dir = tmp_path / ".continuum"
        self.output = tmp_path / "continuum-up.out"
        argv = [str(CONTINUUM), "up", *(f"--{name}-port=0" for name in COMPONENTS)]
        with open(self.output, "wb") as output:
            self.process = subprocess.Popen(
                argv, cwd=self.checkout, env=newcomer_env(), stdout=output, stderr=subprocess.STDOUT
            )
        self.child_pids: set[int] = set()
        # `continuum follow` and `cleanup` an operator ran against this run.
        self.operator_processes: list[subprocess.Popen[bytes]] = []

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
        for operator in self.operator_processes:
            if operator.poll() is None:
                operator.kill()
            operator.wait()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for pid in self.child_pids:
            # Children lead their own process groups; the cmdline check guards against a reused pid.
            if runs(pid, b"continuum_"):
                os.killpg(pid, signal.SIGKILL)

    def supervisor_running(self) -> None:
        if self.process.poll() is not None:
            pytest.fail(f"`continuum up` exited early\n{self.diagnostics()}")

    @contextlib.contextmanager
    def gateway(self) -> Iterator[httpx.Client]:
        """A client of the gateway once every component is ready, as the dev user."""

        def port_files_written() -> bool:
            self.supervisor_running()
            return all(self.port(name) is not None for name in COMPONENTS)

        wait_for(port_files_written, what="the port files", seconds=START_TIMEOUT, diagnostics=self.diagnostics)
        base_url = f"http://127.0.0.1:{self.port('gateway')}"
        with httpx.Client(base_url=base_url, timeout=10.0, trust_env=False) as client:

            def ready() -> bool:
                self.supervisor_running()
                try:
                    return client.get("/readyz").status_code == httpx.codes.OK
                except httpx.TransportError:
                    return False

            wait_for(ready, what="GET /readyz 200", seconds=START_TIMEOUT, diagnostics=self.diagnostics)
            self.remember_children()
            client.headers["Authorization"] = f"Bearer {(self.data_dir / 'dev-token').read_text().strip()}"
            yield client

    def stop(self) -> None:
        """Ctrl-C, as the newcomer stops it: every child gone, exit 0."""
        assert len(self.child_pids) == len(COMPONENTS), self.diagnostics()
        self.process.send_signal(signal.SIGINT)
        try:
            code = self.process.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"`continuum up` did not exit within {STOP_TIMEOUT} s of SIGINT\n{self.diagnostics()}")
        assert code == 0, self.diagnostics()
        assert not [pid for pid in self.child_pids if alive(pid)], self.diagnostics()


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Run]:
    started = Run(tmp_path)
    try:
        yield started
    finally:
        started.kill_leftovers()


def create_session(client: httpx.Client, title: str, texts: tuple[str, ...] = ()) -> str:
    created = client.post("/v1/sessions", json={"title": title})
    assert created.status_code == httpx.codes.CREATED, created.text
    session_id: str = created.json()["session"]["sessionId"]
    for text in texts:
        appended = client.post(
            f"/v1/sessions/{session_id}/messages",
            json={"messages": [{"role": "MESSAGE_ROLE_USER", "content": [{"text": text}]}]},
        )
        assert appended.is_success, appended.text
    return session_id


def test_up_serves_sessions_messages_compaction_and_merges_and_stops_on_ctrl_c(run: Run) -> None:
    with run.gateway() as client:
        assert (run.data_dir / "dev-token").stat().st_mode & 0o777 == 0o600

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
        # The gateway reaches merge, which claims both sessions through transcript.
        capabilities = client.get("/v1/capabilities")
        other = create_session(client, "e2e other", ("third",))
        merge_request = {"sourceSessionIds": [session_id, other], "primarySessionId": session_id}
        started = client.post("/v1/session-merges", json={**merge_request, "idempotencyKey": "e2e-merge"})
        location = started.headers.get("Location", "/v1/session-merges/none")
        read = client.get(location)
        # Merge's worker runs it through the real stages (the offline provider) to a published target.

        def completed() -> bool:
            status = client.get(location).json()["operation"]["progress"]["status"]
            assert status in ("MERGE_STATUS_PREPARING", "MERGE_STATUS_COMPLETED"), status
            return bool(status == "MERGE_STATUS_COMPLETED")

        wait_for(completed, what="the merge completed", seconds=START_TIMEOUT, diagnostics=run.diagnostics)
        done = client.get(location).json()["operation"]["progress"]
        target = client.get(f"/v1/sessions/{done['targetSessionId']}")

    assert (summary.status_code, summary.json()) == (httpx.codes.OK, {"data": None}), summary.text
    assert compacted.status_code == httpx.codes.OK, compacted.text
    assert compacted.json()["state"] == "COMPACT_NOW_STATE_COMPLETED"

    assert "merge-v2" in capabilities.json()["capabilities"], capabilities.text
    assert started.status_code == httpx.codes.CREATED, started.text
    operation_id = started.json()["operation"]["progress"]["operationId"]
    assert read.status_code == httpx.codes.OK, read.text
    assert read.json()["operation"]["progress"]["operationId"] == operation_id
    assert read.json()["operation"]["parameters"]["sourceSessionIds"] == [session_id, other]
    assert target.json()["session"]["kind"] == "SESSION_KIND_MERGED", target.text
    # Its package is in the data dir, private like everything there.
    package = run.data_dir / "merge-packages" / operation_id
    assert (package / "snapshot" / "seal.json").exists(), run.diagnostics()
    assert {path.stat().st_mode & 0o777 for path in package.rglob("*")} <= {0o600, 0o700}

    assert listed.status_code == httpx.codes.OK, listed.text
    messages = listed.json()["messages"]
    assert [message["content"] for message in messages] == [[{"text": "first"}], [{"text": "second"}]]
    assert [message["role"] for message in messages] == ["MESSAGE_ROLE_USER"] * 2
    # int64 ids travel as JSON strings (proto3 JSON mapping).
    ids = [int(message["messageId"]) for message in messages]
    assert ids == sorted(ids)
    assert ids[0] < ids[1]

    run.stop()


def test_up_runs_a_turn_of_the_reference_agent_through_the_gateway(run: Run) -> None:
    (run.checkout / "notes.md").write_text("displayName is the new name\n")
    with run.gateway() as client:
        capabilities = client.get("/v1/capabilities").json()["capabilities"]
        created = client.post("/v1/sessions", json={"title": "turn", "workingDirectory": str(run.checkout)})
        session_id = created.json()["session"]["sessionId"]
        started = client.post(f"/v1/sessions/{session_id}/turns", json={"text": "where is displayName?"})
        assert started.status_code == httpx.codes.ACCEPTED, started.text

        def answered() -> bool:
            listed = client.get(f"/v1/sessions/{session_id}/messages").json()["messages"]
            return len(listed) == 5 and listed[-1]["status"] == "MESSAGE_STATUS_COMPLETE"

        wait_for(answered, what="the turn's answer", seconds=START_TIMEOUT, diagnostics=run.diagnostics)
        messages = client.get(f"/v1/sessions/{session_id}/messages").json()["messages"]

    assert "agent-v1" in capabilities
    assert [m["role"].removeprefix("MESSAGE_ROLE_") for m in messages] == [
        "USER",
        "ASSISTANT",
        "TOOL",
        "TOOL",
        "ASSISTANT",
    ]
    assert "notes.md" in messages[2]["content"][0]["text"]
    run.stop()


def upload_attachment(run: Run, session_id: str) -> None:
    """Store attachment bytes through transcript's gRPC API, as an agent runtime holding the service token does."""
    token = (run.data_dir / "service-token").read_text().strip()
    frames = [
        api.UploadAttachmentRequest(
            header=api.UploadAttachmentHeader(session_id=session_id, media_type="text/plain", file_name="a.txt")
        ),
        api.UploadAttachmentRequest(chunk=b"attached"),
    ]
    with grpc.insecure_channel(f"127.0.0.1:{run.port('transcript')}", options=[("grpc.enable_http_proxy", 0)]) as ch:
        api_grpc.TranscriptServiceStub(ch).UploadAttachment(iter(frames), metadata=call_metadata(token, "dev"))


def test_everything_up_and_its_services_keep_in_the_data_dir_is_private(run: Run) -> None:
    with run.gateway() as client:
        session_id = create_session(client, "private", ("a message",))
        upload_attachment(run, session_id)
        assert client.post(f"/v1/sessions/{session_id}/compaction:compactNow").is_success

    modes = {
        str(path.relative_to(run.data_dir)): path.stat().st_mode & 0o777
        for path in [run.data_dir, *run.data_dir.rglob("*")]
    }

    # What the supervisor writes, and what each service writes itself (databases, attachments, port files).
    expected = {"dev-token", "service-token", "page-token-secret", "transcript.db", "compaction.db", "merge.db"}
    expected |= {"attachments", "logs/transcript.log", "logs/merge.log", "run/transcript.port", "run/merge.port"}
    expected |= {"run/gateway.port", "run/handoff-read.port", "logs/handoff-read.log"}
    assert expected <= set(modes), sorted(modes)
    assert [path for path in modes if path.startswith("attachments/") and modes[path] == 0o600]
    assert {path: mode for path, mode in modes.items() if mode not in (0o600, 0o700)} == {}
    assert all(mode == 0o700 for path, mode in modes.items() if (run.data_dir / path).is_dir())
    run.stop()


def operator_command(run: Run, arguments: list[str], *, cwd: Path, env: dict[str, str] | None = None) -> Path:
    """Start `continuum <arguments>` as an operator's shell would (no token exported); its output file."""
    output = cwd / f"continuum-{arguments[0]}-{len(list(cwd.glob('continuum-*.out')))}.out"
    with open(output, "wb") as out:
        process = subprocess.Popen(
            [str(CONTINUUM), *arguments], cwd=cwd, env={**newcomer_env(), **(env or {})}, stdout=out, stderr=out
        )
    run.operator_processes.append(process)
    return output


def wait_for_output(output: Path, text: str, run: Run) -> None:
    """Wait until a command's output shows `text`; fail with that output and the run's logs otherwise."""

    def shown() -> bool:
        return text in output.read_text(errors="replace")

    def diagnostics() -> str:
        return f"--- {output.name}:\n{output.read_text(errors='replace')}\n{run.diagnostics()}"

    wait_for(shown, what=f"{text!r} in {output.name}", seconds=COMMAND_TIMEOUT, diagnostics=diagnostics)


def test_an_operator_follows_and_cleans_up_what_up_started_with_no_token_exported(run: Run, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with run.gateway() as client:
        session_id = create_session(client, "followed", ("first", "second"))
        doomed = create_session(client, "doomed")
        assert client.delete(f"/v1/sessions/{doomed}").is_success

    # What `up` prints is what works from the checkout: its data dir is the default one. It prints once
    # its own readiness check of the gateway passed, which may come after the client's.
    wait_for_output(run.output, "Press Ctrl-C to stop.", run)
    printed = run.output.read_text().splitlines()
    assert f"  {CONTINUUM} follow <session-id>" in printed, run.diagnostics()
    assert f"  {CONTINUUM} cleanup compaction" in printed, run.diagnostics()
    assert f"  {CONTINUUM} cleanup merge" in printed, run.diagnostics()
    # From the checkout (default ./.continuum), with --data-dir, and with $CONTINUUM_DATA_DIR.
    followers = [
        operator_command(run, ["follow", session_id], cwd=run.checkout),
        operator_command(run, ["follow", session_id, "--data-dir", str(run.data_dir)], cwd=elsewhere),
        operator_command(run, ["follow", session_id], cwd=elsewhere, env={"CONTINUUM_DATA_DIR": str(run.data_dir)}),
    ]
    for output in followers:
        wait_for_output(output, "user: second", run)
        assert "user: first" in output.read_text()
    for process in list(run.operator_processes):
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=COMMAND_TIMEOUT) == 0

    cleanup = operator_command(run, ["cleanup", "compaction", "--data-dir", str(run.data_dir)], cwd=elsewhere)
    assert run.operator_processes[-1].wait(timeout=COMMAND_TIMEOUT) == 0, cleanup.read_text() + run.diagnostics()
    # It reached transcript with the run's token and found the deleted session's event.
    assert "checked 1 deleted-session event(s)" in cleanup.read_text()
    # Merge's reconcile reads the run's database and package root, and reaches transcript the same way.
    merge_cleanup = operator_command(run, ["cleanup", "merge", "--data-dir", str(run.data_dir)], cwd=elsewhere)
    assert run.operator_processes[-1].wait(timeout=COMMAND_TIMEOUT) == 0, merge_cleanup.read_text() + run.diagnostics()
    assert "checked 0 package(s); removed 0" in merge_cleanup.read_text()
    run.stop()


def make_dry_run(*arguments: str) -> list[str]:
    """The commands `make <arguments>` would run in a fresh checkout (every target out of date), one per line."""
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run(
        ["make", "--dry-run", "--always-make", "--no-print-directory", *arguments],
        cwd=root,
        env=newcomer_env(),
        capture_output=True,
        text=True,
        check=True,
        timeout=COMMAND_TIMEOUT,
    )
    return result.stdout.splitlines()


def test_make_run_installs_only_runtime_dependencies_and_passes_options_to_up() -> None:
    commands = make_dry_run("run", "ARGS=--gateway-port 9090 --data-dir /tmp/x")

    installs = [command for command in commands if "pip install" in command]
    assert any(command.endswith("-r requirements.txt") for command in installs), commands
    assert not [command for command in installs if "requirements-dev.txt" in command], commands
    assert commands[-1] == ".venv/bin/continuum up --gateway-port 9090 --data-dir /tmp/x"


def test_make_test_installs_the_development_tools_and_lints_imports() -> None:
    commands = make_dry_run("test")

    assert any(command.endswith("-r requirements-dev.txt") for command in commands), commands
    assert any("lint-imports" in command for command in commands), commands
