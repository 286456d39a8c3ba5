"""`continuum up`: start every component as a child process in dependency order, watch them, stop them in reverse."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import httpx

from continuum_cli import demo
from continuum_cli.components import COMPONENTS, Component, Protocol, check_order
from continuum_cli.datadir import resolve_data_dir
from continuum_cli.health import probe
from continuum_cli.ports import port_in_use
from continuum_cli.rundir import LOCAL_HOST, PRIVATE_UMASK, DataDirInUse, RunDir
from continuum_cli.tokens import (
    DEV_TOKEN_FILE,
    SERVICE_TOKEN_FILE,
    load_or_create_dev_token,
    load_or_create_page_token_secret,
    new_token,
    write_service_token,
)

EXIT_OK = 0
EXIT_FAILED = 1
# Generous: the first start of a service runs its migrations before it binds.
STARTUP_TIMEOUT_SECONDS = 60.0
STOP_GRACE_SECONDS = 10.0
POLL_SECONDS = 0.1
LOG_TAIL_LINES = 20
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StartupFailed(Exception):
    """A component exited or did not become ready in time; the message names it."""

    def __init__(self, child: Child, reason: str) -> None:
        super().__init__(f"{child.component.name} {reason}")
        self.child = child


@dataclass
class Child:
    """A started component process and where its output goes."""

    component: Component
    process: subprocess.Popen[bytes]
    log_path: Path
    # Where this run's output starts in the (appended) log file, for the tail shown on failure.
    log_offset: int
    port: int | None = None


def component_env(
    component: Component,
    *,
    data_dir: Path,
    port: int,
    service_token: str,
    dev_token: str,
    page_token_secret: str,
    addresses: Mapping[str, str],
) -> dict[str, str]:
    """The prefixed variables that configure `component` (see `Component`); added on top of the parent's environment."""
    env = {
        component.variable("DATA_DIR"): str(data_dir),
        component.variable("HOST"): LOCAL_HOST,
        component.variable("PORT"): str(port),
        component.variable("SERVICE_TOKEN"): service_token,
        **component.directory_env(data_dir),
    }
    for dependency in component.depends_on:
        env[component.address_variable(dependency)] = addresses[dependency]
    if component.dev_token:
        env[component.variable("DEV_TOKEN")] = dev_token
    if component.signs_page_tokens:
        env[component.variable("PAGE_TOKEN_SECRET")] = page_token_secret
    return env


def describe_exit(code: int) -> str:
    """'code 3' or 'signal SIGKILL' (Popen reports death by signal as a negative code)."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
        return f"signal {-code}"
    return f"code {code}"


class Supervisor:
    """Runs `components` under one data dir until a stop signal or a child's unexpected exit."""

    def __init__(
        self,
        data_dir: Path,
        ports: Mapping[str, int],
        components: Sequence[Component] = COMPONENTS,
        *,
        startup_timeout: float = STARTUP_TIMEOUT_SECONDS,
        stop_grace: float = STOP_GRACE_SECONDS,
        seed_demo: bool = True,
    ) -> None:
        check_order(components)
        self.seed_demo = seed_demo
        self.data_dir = data_dir.resolve()
        self.run_dir = RunDir(self.data_dir)
        self.ports = dict(ports)
        self.components = tuple(components)
        self.startup_timeout = startup_timeout
        self.stop_grace = stop_grace
        self.children: list[Child] = []
        self.signals_received = 0
        self._lock_fd = -1

    def run(self) -> int:
        """Start, watch and stop everything; the process exit code."""
        previous = {signum: signal.signal(signum, self._on_signal) for signum in STOP_SIGNALS}
        # Everything this run creates, and every file its children create (they inherit the umask:
        # databases, attachments, port files), is the operator's alone.
        previous_umask = os.umask(PRIVATE_UMASK)
        # Decided before anything is created: only an empty data dir gets the demo.
        was_empty = demo.is_empty(self.data_dir)
        try:
            self.run_dir.create()
            if self.seed_demo and was_empty:
                demo.promise(self.data_dir)
            try:
                self._lock_fd = self.run_dir.lock()
            except DataDirInUse as error:
                self._say_error(str(error))
                return EXIT_FAILED
            try:
                return self._run_locked(seed=self.seed_demo and demo.wanted(self.data_dir, was_empty))
            finally:
                # Normally a no-op; after an unexpected error it keeps children from outliving us.
                self._stop_all()
                os.close(self._lock_fd)
        finally:
            os.umask(previous_umask)
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _run_locked(self, seed: bool) -> int:
        exposed = self.run_dir.exposed_mode()
        if exposed is not None:
            self._say_error(
                f"warning: other users may read {self.data_dir} (mode {exposed:o}), which keeps tokens and "
                f"conversations; `chmod 700 {shlex.quote(str(self.data_dir))}` makes it private"
            )
        clashes = [
            f"{component.name}'s port {port} is already in use: pass --{component.name}-port N "
            f'(with make: make run ARGS="--{component.name}-port N"); 0 picks any free port'
            for component in self.components
            if (port := self._port(component)) and port_in_use(LOCAL_HOST, port)
        ]
        if clashes:
            for clash in clashes:
                self._say_error(clash)
            return EXIT_FAILED
        dev_token = load_or_create_dev_token(self.data_dir)
        page_token_secret = load_or_create_page_token_secret(self.data_dir)
        # Fresh every run and never printed: the children get it through their environment, the
        # operator's `continuum follow` and `cleanup` from this private file.
        service_token = new_token()
        write_service_token(self.data_dir, service_token)
        self.run_dir.remove_stale(component.name for component in self.components)
        try:
            for component in self.components:
                if self.signals_received:
                    break
                self._start(
                    component, service_token=service_token, dev_token=dev_token, page_token_secret=page_token_secret
                )
        except StartupFailed as failure:
            self._say_error(f"{failure}; stopping the others")
            self._show_log_tail(failure.child)
            self._stop_all()
            return EXIT_FAILED
        if not self.signals_received:
            if seed:
                self._seed(dev_token)
            self._print_summary(dev_token)
            exited = self._watch()
            if exited is not None:
                code = exited.process.returncode
                self._say_error(
                    f"{exited.component.name} exited unexpectedly with {describe_exit(code)}; stopping the others"
                )
                self._show_log_tail(exited)
                self._stop_all()
                return EXIT_FAILED
        self._say("stopping")
        self._stop_all()
        self._say("stopped")
        return EXIT_OK

    def _entry(self) -> Child | None:
        """The browser-facing component (the gateway), if this run has one."""
        return next((c for c in self.children if c.component.protocol is Protocol.HTTP and c.component.dev_token), None)

    def _seed(self, dev_token: str) -> None:
        """The demo workspace, through the gateway; a failure is reported and the run goes on."""
        entry = self._entry()
        if entry is None:
            return
        self._say("seeding the demo workspace (this data dir was empty)")
        try:
            demo.DemoSeeder(self._address(entry), dev_token, self.data_dir).seed()
        except httpx.HTTPError as error:
            self._say_error(f"the demo could not be seeded ({type(error).__name__}); the next run tries again")

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only count here: the main loop polls, so nothing re-entrant happens inside the handler.
        self.signals_received += 1

    def _start(self, component: Component, *, service_token: str, dev_token: str, page_token_secret: str) -> None:
        addresses = {child.component.name: f"{LOCAL_HOST}:{child.port}" for child in self.children}
        env = dict(os.environ)
        env.update(
            component_env(
                component,
                data_dir=self.data_dir,
                port=self._port(component),
                service_token=service_token,
                dev_token=dev_token,
                page_token_secret=page_token_secret,
                addresses=addresses,
            )
        )
        log_path = self.run_dir.log_file(component.name)
        self._say(f"starting {component.name}")
        with os.fdopen(self.run_dir.open_log(component.name), "ab") as log:
            log_offset = log.seek(0, os.SEEK_END)
            process = subprocess.Popen(
                [sys.executable, "-m", *component.argv],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Own process group: a terminal's Ctrl-C reaches only the supervisor, which stops
                # the children one at a time in reverse dependency order.
                process_group=0,
                # Orphans of a killed supervisor keep the data dir locked (see RunDir.lock).
                pass_fds=(self._lock_fd,),
            )
        child = Child(component, process, log_path, log_offset)
        self.children.append(child)
        self.run_dir.write_pid(component.name, process.pid)
        self._await_ready(child)

    def _await_ready(self, child: Child) -> None:
        name = child.component.name
        deadline = time.monotonic() + self.startup_timeout
        why_not = f"it wrote no {self.run_dir.port_file(name)}"
        while not self.signals_received:
            code = child.process.poll()
            if code is not None:
                raise StartupFailed(child, f"exited with {describe_exit(code)} while starting")
            port = self.run_dir.read_port(name)
            if port is not None:
                reason = probe(child.component.protocol, LOCAL_HOST, port)
                if reason is None:
                    child.port = port
                    self._say(f"{name} ready on {self._address(child)}")
                    return
                why_not = f"{reason} on port {port}"
            if time.monotonic() >= deadline:
                raise StartupFailed(child, f"did not become ready within {self.startup_timeout:g} s ({why_not})")
            time.sleep(POLL_SECONDS)

    def _watch(self) -> Child | None:
        """Block until a stop signal (None) or until a child exits (that child)."""
        while not self.signals_received:
            for child in self.children:
                if child.process.poll() is not None:
                    return child
            time.sleep(POLL_SECONDS)
        return None

    def _stop_all(self) -> None:
        # One more signal while stopping means "now": skip the remaining grace periods.
        force_at = self.signals_received + 1
        for child in reversed(self.children):
            self._stop(child, force_at)
        self.children.clear()

    def _stop(self, child: Child, force_at: int) -> None:
        process = child.process
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.stop_grace
            while process.poll() is None and time.monotonic() < deadline and self.signals_received < force_at:
                time.sleep(POLL_SECONDS)
            if process.poll() is None:
                self._say_error(f"{child.component.name} did not stop in time; killing it")
                # The whole group, so nothing the child started outlives it. The group id cannot have
                # been reused yet: the unreaped child still holds it.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self.run_dir.forget(child.component.name)

    def _port(self, component: Component) -> int:
        return self.ports.get(component.name, component.default_port)

    def _address(self, child: Child) -> str:
        if child.component.protocol is Protocol.HTTP:
            return f"http://{LOCAL_HOST}:{child.port}"
        return f"{LOCAL_HOST}:{child.port} (gRPC)"

    def _print_summary(self, dev_token: str) -> None:
        width = max(len(child.component.name) for child in self.children)
        lines = ["", f"Continuum is up. Data dir: {self.data_dir}"]
        lines += [f"  {child.component.name:<{width}}  {self._address(child)}" for child in self.children]
        lines += [
            f"Logs (JSON lines) go to {self.run_dir.logs_dir}/<component>.log, not to this terminal.",
            f"Dev token (user 'dev', kept in {self.data_dir / DEV_TOKEN_FILE}): {dev_token}",
            f"Operator commands (they read this run's service token from {self.data_dir / SERVICE_TOKEN_FILE}):",
            f"  {self._operator_command('follow <session-id>')}",
        ]
        lines += [
            f"  {self._operator_command(f'cleanup {child.component.name}')}"
            for child in self.children
            if child.component.cleans_up
        ]
        entry = self._entry()
        if entry is not None:
            url = f"{self._address(entry)}/v1/sessions"
            lines += [
                f"Console: {self._address(entry)}/  (sign in with the dev token)",
                "Try:",
                f"  curl -X POST {url} -H {shlex.quote('Authorization: Bearer ' + dev_token)} "
                f"-H 'Content-Type: application/json' -d '{{\"title\": \"hello\"}}'",
            ]
        lines += ["Press Ctrl-C to stop.", ""]
        print("\n".join(lines), file=sys.stdout, flush=True)

    def _operator_command(self, arguments: str) -> str:
        """How to run `continuum <arguments>` against this run, as the operator started `up`."""
        # `.venv/bin/continuum` when started that way (`make run`): the venv need not be active.
        program = sys.argv[0] if Path(sys.argv[0]).name == "continuum" else "continuum"
        command = f"{program} {arguments}"
        if resolve_data_dir(None).resolve() != self.data_dir:
            command += f" --data-dir {shlex.quote(str(self.data_dir))}"
        return command

    def _show_log_tail(self, child: Child) -> None:
        try:
            with open(child.log_path, "rb") as log:
                log.seek(child.log_offset)
                tail = log.read().decode("utf-8", "replace").splitlines()[-LOG_TAIL_LINES:]
        except OSError:
            return
        if tail:
            self._say_error(f"last lines of {child.log_path}:")
            for line in tail:
                print(f"  | {line}", file=sys.stderr)
            sys.stderr.flush()

    def _say(self, message: str) -> None:
        print(f"continuum: {message}", file=sys.stdout, flush=True)

    def _say_error(self, message: str) -> None:
        print(f"continuum: {message}", file=sys.stderr, flush=True)


def up(data_dir: Path, ports: Mapping[str, int], components: Sequence[Component] = COMPONENTS) -> int:
    """Run `continuum up` with `components` (default: the known ones); the process exit code."""
    return Supervisor(data_dir, ports, components).run()
