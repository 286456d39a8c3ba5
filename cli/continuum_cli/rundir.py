"""The run directory of a data dir: the lock, and each component's port, pid and log files."""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from collections.abc import Iterable
from pathlib import Path

# Components bind loopback only: the dev token is a local convenience, not a credential to expose on a network.
LOCAL_HOST = "127.0.0.1"
# What a local run creates is its operator's alone: files 0600, directories 0700 (tokens, databases,
# attachments and logs hold other people's conversations and credentials).
PRIVATE_UMASK = 0o077
PRIVATE_DIR_MODE = 0o700


class DataDirInUse(Exception):
    """Another `continuum up`, or children one left running, holds the data dir."""


class RunDir:
    """Paths under `<data_dir>/run` and `<data_dir>/logs`, named after components."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.run_dir = data_dir / "run"
        self.logs_dir = data_dir / "logs"

    def port_file(self, name: str) -> Path:
        """Where component `name` publishes its bound port."""
        return self.run_dir / f"{name}.port"

    def pid_file(self, name: str) -> Path:
        """Where the supervisor records component `name`'s process id while it runs."""
        return self.run_dir / f"{name}.pid"

    def log_file(self, name: str) -> Path:
        """Where component `name`'s stdout and stderr (JSON log lines) are appended."""
        return self.logs_dir / f"{name}.log"

    def address(self, name: str) -> str | None:
        """ "127.0.0.1:<port>" of component `name` while a local run publishes its port, else None."""
        port = self.read_port(name)
        return None if port is None else f"{LOCAL_HOST}:{port}"

    def create(self) -> None:
        """Create the data, run and log directories, private to the operator (0700).

        A directory that already exists keeps its mode: the data dir may be one the operator chose
        for other things too (see `exposed_mode`).
        """
        for directory in (self.data_dir, self.run_dir, self.logs_dir):
            directory.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)

    def exposed_mode(self) -> int | None:
        """The data dir's permission bits when other users may enter or read it, else None."""
        mode = stat.S_IMODE(self.data_dir.stat().st_mode)
        return mode if mode & 0o077 else None

    def open_log(self, name: str) -> int:
        """Open component `name`'s log for appending, private (0600) even if an older run left it readable."""
        fd = os.open(self.log_file(name), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.fchmod(fd, 0o600)
        return fd

    def lock(self) -> int:
        """Take the data dir's exclusive lock and return its file descriptor (held until every holder closes it).

        The supervisor passes the descriptor to its children, so children orphaned by a killed
        supervisor keep the data dir locked instead of a second `up` fighting them over ports and files.
        """
        fd = os.open(self.run_dir / "up.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holders = ", ".join(f"{path.stem} pid {pid}" for path, pid in self._recorded_pids()) or "unknown pids"
            raise DataDirInUse(
                f"{self.data_dir} is in use by another `continuum up` or by processes one left running ({holders})"
            ) from None
        return fd

    def remove_stale(self, names: Iterable[str]) -> None:
        """Delete port and pid files a previous run left, so a port file read later is this run's."""
        for name in names:
            # `<name>.tmp` is the scratch file of the services' atomic port-file write.
            for path in (self.port_file(name), self.pid_file(name), self.run_dir / f"{name}.tmp"):
                path.unlink(missing_ok=True)

    def read_port(self, name: str) -> int | None:
        """The port component `name` published, or None while it has not."""
        try:
            text = self.port_file(name).read_text(encoding="ascii").strip()
        except FileNotFoundError:
            return None
        # The services rename a complete file into place, but tolerate a half-written one from elsewhere.
        if not text.isdigit() or not 0 < int(text) < 65536:
            return None
        return int(text)

    def write_pid(self, name: str, pid: int) -> None:
        """Record a started child's pid (tests and operators find the children by these files)."""
        scratch = self.run_dir / f"{name}.pid.tmp"
        scratch.write_text(f"{pid}\n", encoding="ascii")
        scratch.replace(self.pid_file(name))

    def forget(self, name: str) -> None:
        """Remove the run files of a component that has exited."""
        self.port_file(name).unlink(missing_ok=True)
        self.pid_file(name).unlink(missing_ok=True)

    def _recorded_pids(self) -> list[tuple[Path, int]]:
        found = []
        for path in sorted(self.run_dir.glob("*.pid")):
            with contextlib.suppress(OSError, ValueError):
                found.append((path, int(path.read_text(encoding="ascii").strip())))
        return found
