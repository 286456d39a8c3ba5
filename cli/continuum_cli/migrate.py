"""`continuum migrate <service>`: run one service's database migrations (what a Kubernetes Job runs)."""

from __future__ import annotations

import os
import sys

from continuum_cli.components import Component

EXIT_FAILED = 1


def migrate(component: Component) -> int:
    """Replace this process with `python -m <module> migrate`; returns only if that cannot start.

    Exec rather than a child process: the service then receives the Job's signals directly and
    its exit code is the command's exit code, with nothing in between to forward or translate.
    The environment (the service's `<PREFIX>*` variables) is inherited unchanged.
    """
    argv = [sys.executable, "-m", component.module, "migrate"]
    # Buffered output would be lost when exec replaces the process image.
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(sys.executable, argv)
    except OSError as error:
        print(f"continuum: cannot run {' '.join(argv)}: {error}", file=sys.stderr)
        return EXIT_FAILED
