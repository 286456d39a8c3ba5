"""`continuum migrate <service>` and `continuum cleanup <service>`: run one service's own maintenance
command, as a Kubernetes Job (migrate) or CronJob (cleanup) runs it."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from continuum_cli.components import Component
from continuum_cli.rundir import PRIVATE_UMASK, RunDir
from continuum_cli.tokens import PAGE_TOKEN_SECRET_FILE, SERVICE_TOKEN_FILE, read_token

EXIT_FAILED = 1
# As argparse exits on a command line it refuses.
EXIT_USAGE = 2


def migrate(component: Component) -> int:
    """Bring the service's schema to head: `python -m <module> migrate`; see `run_module_command`."""
    return run_module_command(component, "migrate", os.environ)


def cleanup(component: Component, data_dir: Path) -> int:
    """Remove what the service holds for deleted data: `python -m <module> cleanup`; see `run_module_command`.

    Configured like the service `continuum up` runs in `data_dir` (see `local_env`). Refused when there is
    no such data dir and the environment does not place the service's data either: the service would
    create an empty database there and report that it removed nothing.
    """
    # An empty value is no value to the service's settings either.
    placed_by_environment = any(os.environ.get(component.variable(name)) for name in ("DATABASE_URL", "DATA_DIR"))
    if not data_dir.is_dir() and not placed_by_environment:
        print(
            f"continuum: no data dir at {data_dir}: run this where `continuum up` keeps its data (the checkout,"
            f" for `make run`), or pass --data-dir DIR (or set CONTINUUM_DATA_DIR); against a deployment, set"
            f" {component.variable('DATABASE_URL')}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    return run_module_command(component, "cleanup", local_env(component, data_dir, os.environ))


def local_env(component: Component, data_dir: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """`environ`, plus what `data_dir` tells about the local run there for the variables `environ` lacks.

    The data dir supplies `<P>DATA_DIR` and the component's directories in it, and while `continuum
    up` runs there its service token, page-token secret and the addresses of the component's
    dependencies. A variable the operator set
    wins, so the same command serves a deployment configured only by its environment.
    """
    supplied = {component.variable("DATA_DIR"): str(data_dir.resolve()), **component.directory_env(data_dir.resolve())}
    service_token = read_token(data_dir / SERVICE_TOKEN_FILE)
    if service_token is not None:
        supplied[component.variable("SERVICE_TOKEN")] = service_token
    page_token_secret = read_token(data_dir / PAGE_TOKEN_SECRET_FILE)
    if component.signs_page_tokens and page_token_secret is not None:
        supplied[component.variable("PAGE_TOKEN_SECRET")] = page_token_secret
    run_dir = RunDir(data_dir)
    for dependency in component.depends_on:
        address = run_dir.address(dependency)
        if address is not None:
            supplied[component.address_variable(dependency)] = address
    return {**supplied, **environ}


def run_module_command(component: Component, command: str, env: Mapping[str, str]) -> int:
    """Replace this process with `python -m <module> <command>` in `env`; returns only if that cannot start.

    Exec rather than a child process: the service then receives the Job's signals directly and
    its exit code is the command's exit code, with nothing in between to forward or translate.
    """
    argv = [sys.executable, "-m", component.module, command]
    # Buffered output would be lost when exec replaces the process image.
    sys.stdout.flush()
    sys.stderr.flush()
    # What the command creates (a first SQLite file, say) is private, as under `continuum up`.
    os.umask(PRIVATE_UMASK)
    try:
        os.execve(sys.executable, argv, dict(env))
    except OSError as error:
        print(f"continuum: cannot run {' '.join(argv)}: {error}", file=sys.stderr)
        return EXIT_FAILED
