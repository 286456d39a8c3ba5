"""`python -m continuum_handoff_read serve`: the service (it owns no tables, so it has no migration)."""

from __future__ import annotations

import argparse

from continuum_handoff_read import SERVICE_NAME
from continuum_handoff_read.server import start
from continuum_handoff_read.settings import HandoffReadSettings
from continuum_runtime.logs import configure_logging
from continuum_runtime.server import run, serve


async def _serve(settings: HandoffReadSettings) -> None:
    await serve(await start(settings), settings)


def main() -> None:
    """Parse the command, read settings once, run."""
    parser = argparse.ArgumentParser(prog="python -m continuum_handoff_read")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("serve", help="run the gRPC service")
    parser.parse_args()
    settings = HandoffReadSettings()
    configure_logging(settings.log_level, SERVICE_NAME)
    run(_serve(settings))


if __name__ == "__main__":
    main()
