"""`python -m continuum_merge serve|migrate`: the service and its migration Job."""

from __future__ import annotations

import argparse
import asyncio

from continuum_merge import SERVICE_NAME
from continuum_merge.server import migrate, start
from continuum_merge.settings import MergeSettings
from continuum_runtime.logs import configure_logging
from continuum_runtime.server import serve


async def _serve(settings: MergeSettings) -> None:
    await serve(await start(settings), settings)


def main() -> None:
    """Parse the command, read settings once, run."""
    parser = argparse.ArgumentParser(prog="python -m continuum_merge")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("serve", help="run the gRPC service")
    commands.add_parser("migrate", help="bring the schema to head")
    arguments = parser.parse_args()
    settings = MergeSettings()
    configure_logging(settings.log_level, SERVICE_NAME)
    if arguments.command == "serve":
        asyncio.run(_serve(settings))
    else:
        asyncio.run(migrate(settings))


if __name__ == "__main__":
    main()
