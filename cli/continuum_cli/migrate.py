"""`continuum migrate <service>` and `continuum cleanup <service>`: run one service's own maintenance
command, as a Kubernetes Job (migrate) or CronJob (cleanup) runs it."""

from __future__ import annotations

import os
import sys

from continuum_cli.components import Component

EXIT_FAILED = 1


def migrate(component: Component) -> int:
    """Bring the service's schema to head: `python -m <module> migrate`; see `run_module_command`."""
    return run_module_command(component, "migrate")


def cleanup(component: Component) -> int:
    """Remove what the service holds for deleted data: `python -m <module> cleanup`; see `run_module_command`."""
    return run_module_command(component, "cleanup")


def run_module_command(component: Component, command: str) -> int:
    """Replace this process with `python -m <module> <command>`; returns only if that cannot start.

    Exec rather than a child process: the service then receives the Job's signals directly and
    its exit code is the command's exit code, with nothing in between to forward or translate.
    The environment (the service's `<PREFIX>*` variables) is inherited unchanged.
    """
    argv = [sys.executable, "-m", component.module, command]
    # Buffered output would be lost when exec replaces the process image.
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(sys.executable, argv)
    except OSError as error:
        print(f"continuum: cannot run {' '.join(argv)}: {error}", file=sys.stderr)
        return EXIT_FAILED
