"""`continuum up`'s supervisor, run for real (own process, real signals) over fake components."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
from deadline_testing import wait_for
from process_testing import alive, children_of, runs

from continuum_cli import demo

HERE = Path(__file__).parent


@dataclass
class Up:
    """A running `cli_fake_up` and where its output goes."""

    process: subprocess.Popen[bytes]
    data_dir: Path
    log_dir: Path

    def stdout(self) -> str:
        return (self.log_dir / "stdout").read_text(encoding="utf-8")

    def stderr(self) -> str:
        return (self.log_dir / "stderr").read_text(encoding="utf-8")

    def pids(self) -> dict[str, int]:
        return {path.stem: int(path.read_text()) for path in (self.data_dir / "run").glob("*.pid")}

    def env_of(self, name: str) -> dict[str, str]:
        recorded: dict[str, str] = json.loads((self.data_dir / f"{name}.env.json").read_text())
        return recorded

    def stops(self) -> list[str]:
        path = self.data_dir / "stops.log"
        return path.read_text().split() if path.exists() else []

    def finish(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"supervisor still running after {timeout} s\n{self.stdout()}\n{self.stderr()}")


StartUp = Callable[..., Up]


@pytest.fixture
def start_up(tmp_path: Path) -> Iterator[StartUp]:
    started: list[tuple[Up, set[int]]] = []

    def start(
        *,
        modes: Mapping[str, str] | None = None,
        startup_timeout: float = 30.0,
        stop_grace: float = 10.0,
        data_dir: Path | None = None,
        ports: Mapping[str, int] | None = None,
        seed_demo: bool = False,
    ) -> Up:
        log_dir = tmp_path / f"up-{len(started)}"
        log_dir.mkdir()
        env = {key: value for key, value in os.environ.items() if not key.startswith("FAKE_")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
        env.update({f"FAKE_{name.upper()}_MODE": mode for name, mode in (modes or {}).items()})
        if seed_demo:
            env["FAKE_SEED_DEMO"] = "1"
        data_dir = data_dir or tmp_path / "data"
        argv = [sys.executable, "-m", "cli_fake_up", str(data_dir), str(startup_timeout), str(stop_grace)]
        argv += [f"{name}={port}" for name, port in (ports or {}).items()]
        with open(log_dir / "stdout", "wb") as out, open(log_dir / "stderr", "wb") as err:
            process = subprocess.Popen(argv, env=env, stdout=out, stderr=err)
        up = Up(process, data_dir, log_dir)
        started.append((up, set()))
        return up

    def remember_children() -> None:
        for up, pids in started:
            if up.process.poll() is None:
                pids.update(children_of(up.process.pid))
            if (up.data_dir / "run").exists():
                pids.update(up.pids().values())

    try:
        yield start
    finally:
        remember_children()
        for up, pids in started:
            if up.process.poll() is None:
                up.process.kill()
            up.process.wait()
            for pid in pids:
                if runs(pid, b"cli_fake_component"):
                    os.kill(pid, signal.SIGKILL)


def wait_until_up(up: Up) -> None:
    wait_for(lambda: "Press Ctrl-C" in up.stdout() or up.process.poll() is not None, what="the summary", seconds=30)
    assert up.process.poll() is None, up.stderr()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_up_configures_children_and_stops_them_in_reverse_order(start_up: StartUp, signum: signal.Signals) -> None:
    up = start_up()
    wait_until_up(up)
    data_dir = up.data_dir.resolve()
    alpha, beta = up.env_of("alpha"), up.env_of("beta")
    dev_token = (data_dir / "dev-token").read_text().strip()
    alpha_port = int((data_dir / "run" / "alpha.port").read_text())

    assert (data_dir / "dev-token").stat().st_mode & 0o777 == 0o600
    assert alpha["ALPHA_DATA_DIR"] == beta["BETA_DATA_DIR"] == str(data_dir)
    assert alpha["ALPHA_HOST"] == beta["BETA_HOST"] == "127.0.0.1"
    assert alpha["ALPHA_PORT"] == beta["BETA_PORT"] == "0"
    assert beta["BETA_ALPHA_ADDRESS"] == f"127.0.0.1:{alpha_port}"
    assert beta["BETA_DEV_TOKEN"] == dev_token
    # Each child gets only its own prefixed variables, and only the browser-facing one the dev token.
    assert not [key for key in alpha if not key.startswith("ALPHA_")]
    assert not [key for key in beta if not key.startswith("BETA_")]
    assert "ALPHA_DEV_TOKEN" not in alpha
    service_token = alpha["ALPHA_SERVICE_TOKEN"]
    assert service_token == beta["BETA_SERVICE_TOKEN"]
    assert len(service_token) >= 32
    assert service_token != dev_token
    # One page-token secret, kept for the next run, for the services only.
    page_token_secret = (data_dir / "page-token-secret").read_text().strip()
    assert alpha["ALPHA_PAGE_TOKEN_SECRET"] == page_token_secret
    assert len(page_token_secret) >= 32
    assert page_token_secret not in (service_token, dev_token)
    assert "BETA_PAGE_TOKEN_SECRET" not in beta
    # The operator's commands find this run's service token in a private file.
    service_token_file = data_dir / "service-token"
    assert service_token_file.read_text().strip() == service_token

    output = up.stdout() + up.stderr()
    assert dev_token in output
    assert f"http://127.0.0.1:{beta_port(up)}" in output
    assert service_token not in output
    assert page_token_secret not in output
    assert f"read this run's service token from {service_token_file}" in output
    assert f"follow <session-id> --data-dir {data_dir}\n" in output

    pids = up.pids()
    assert set(pids) == {"alpha", "beta"}
    assert children_of(up.process.pid) == set(pids.values())

    up.process.send_signal(signum)
    assert up.finish(timeout=20) == 0, up.stderr()
    assert up.stops() == ["beta", "alpha"]
    assert not [pid for pid in pids.values() if alive(pid)]
    assert not list((data_dir / "run").glob("*.p*"))  # no port or pid files left behind


def test_everything_a_run_and_its_children_create_in_the_data_dir_is_private(start_up: StartUp) -> None:
    up = start_up()
    wait_until_up(up)
    # Written by the children (their recorded env, port files) as well as by the supervisor.
    assert (up.data_dir / "alpha.env.json").exists()
    assert (up.data_dir / "run" / "alpha.port").exists()

    modes = {
        str(path.relative_to(up.data_dir)): path.stat().st_mode & 0o777
        for path in [up.data_dir, *up.data_dir.rglob("*")]
    }

    assert {"dev-token", "service-token", "page-token-secret", "logs/alpha.log", "run/up.lock"} <= set(modes)
    assert {name: mode for name, mode in modes.items() if mode not in (0o600, 0o700)} == {}
    assert {name for name, mode in modes.items() if mode == 0o700} == {".", "run", "logs"}


def test_a_data_dir_others_may_read_is_warned_about_and_left_alone(start_up: StartUp, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    log = shared / "logs" / "alpha.log"
    log.parent.mkdir()
    log.write_text("an older run's line\n")
    log.chmod(0o644)

    up = start_up(data_dir=shared)
    wait_until_up(up)

    assert f"warning: other users may read {shared} (mode 755)" in up.stderr()
    assert f"chmod 700 {shared}" in up.stderr()
    assert shared.stat().st_mode & 0o777 == 0o755
    # A log the run appends to is made private, keeping what it held.
    assert log.stat().st_mode & 0o777 == 0o600
    assert log.read_text().startswith("an older run's line\n")


def test_the_page_token_secret_is_kept_across_runs_and_the_service_token_is_not(start_up: StartUp) -> None:
    first = start_up()
    wait_until_up(first)
    secret, token = first.env_of("alpha")["ALPHA_PAGE_TOKEN_SECRET"], first.env_of("alpha")["ALPHA_SERVICE_TOKEN"]
    first.process.send_signal(signal.SIGINT)
    assert first.finish(timeout=20) == 0
    (first.data_dir / "alpha.env.json").unlink()

    second = start_up(data_dir=first.data_dir)
    wait_until_up(second)

    assert second.env_of("alpha")["ALPHA_PAGE_TOKEN_SECRET"] == secret
    assert second.env_of("alpha")["ALPHA_SERVICE_TOKEN"] != token
    assert (second.data_dir / "service-token").read_text().strip() == second.env_of("alpha")["ALPHA_SERVICE_TOKEN"]


def beta_port(up: Up) -> int:
    return int((up.data_dir / "run" / "beta.port").read_text())


def test_child_crashing_at_start_fails_naming_it_and_shows_its_log(start_up: StartUp) -> None:
    up = start_up(modes={"alpha": "crash"})

    assert up.finish(timeout=20) == 1
    assert "alpha exited with code 3 while starting; stopping the others" in up.stderr()
    assert "alpha: boom" in up.stderr()
    assert not (up.data_dir / "beta.env.json").exists()


@pytest.mark.parametrize(
    ("name", "why"),
    [("alpha", "gRPC health status NOT_SERVING on port"), ("beta", "GET /readyz answered 503 on port")],
)
def test_child_never_ready_times_out_and_stops_the_others(start_up: StartUp, name: str, why: str) -> None:
    up = start_up(modes={name: "unready"}, startup_timeout=1.5)

    assert up.finish(timeout=20) == 1
    assert f"{name} did not become ready within 1.5 s ({why}" in up.stderr()
    assert up.stops() == ["beta", "alpha"][["beta", "alpha"].index(name) :]


def test_child_exiting_later_stops_the_others_and_fails(start_up: StartUp) -> None:
    up = start_up(modes={"beta": "exit-later"})

    assert up.finish(timeout=20) == 1
    assert "beta exited unexpectedly with code 4; stopping the others" in up.stderr()
    assert up.stops() == ["alpha"]


def test_child_ignoring_sigterm_is_killed_after_the_grace_period(start_up: StartUp) -> None:
    up = start_up(modes={"beta": "stubborn"}, stop_grace=1.0)
    wait_until_up(up)
    pids = up.pids()

    up.process.send_signal(signal.SIGINT)

    assert up.finish(timeout=15) == 0
    assert "beta did not stop in time; killing it" in up.stderr()
    assert up.stops() == ["alpha"]
    assert not [pid for pid in pids.values() if alive(pid)]


def test_second_interrupt_skips_the_grace_period(start_up: StartUp) -> None:
    up = start_up(modes={"beta": "stubborn"}, stop_grace=60.0)
    wait_until_up(up)
    pids = up.pids()
    up.process.send_signal(signal.SIGINT)
    wait_for(lambda: "stopping" in up.stdout(), what="the supervisor to start stopping", seconds=5)

    up.process.send_signal(signal.SIGINT)

    assert up.finish(timeout=10) == 0
    assert "beta did not stop in time; killing it" in up.stderr()
    assert not [pid for pid in pids.values() if alive(pid)]


def test_second_up_on_the_same_data_dir_is_refused(start_up: StartUp) -> None:
    first = start_up()
    wait_until_up(first)
    ports = {path.name: path.read_text() for path in (first.data_dir / "run").glob("*.port")}

    second = start_up(data_dir=first.data_dir)

    assert second.finish(timeout=20) == 1
    assert "is in use by another `continuum up`" in second.stderr()
    assert first.process.poll() is None
    assert {path.name: path.read_text() for path in (first.data_dir / "run").glob("*.port")} == ports


def test_children_orphaned_by_a_killed_supervisor_keep_the_data_dir_locked(start_up: StartUp) -> None:
    first = start_up()
    wait_until_up(first)
    pids = first.pids()
    first.process.kill()
    first.process.wait()

    second = start_up(data_dir=first.data_dir)

    assert second.finish(timeout=20) == 1
    assert f"alpha pid {pids['alpha']}" in second.stderr()
    assert f"beta pid {pids['beta']}" in second.stderr()


def test_a_fixed_port_already_served_is_refused_before_anything_starts(start_up: StartUp, tmp_path: Path) -> None:
    first = start_up()
    wait_until_up(first)
    # alpha is a gRPC server, which binds with SO_REUSEPORT: a second one would share the port silently.
    taken = int((first.data_dir / "run" / "alpha.port").read_text())

    other = tmp_path / "other"
    second = start_up(data_dir=other, ports={"alpha": taken}, seed_demo=True)

    assert second.finish(timeout=20) == 1
    assert (
        f"alpha's port {taken} is already in use: pass --alpha-port N "
        '(with make: make run ARGS="--alpha-port N"); 0 picks any free port'
    ) in second.stderr()
    assert not (other / "alpha.env.json").exists()
    # The refused first run left its run files behind; the run that follows still owes the demo.
    assert not demo.is_empty(other)
    assert demo.wanted(other, demo.is_empty(other))
