"""`python -m continuum_agent serve`: the reference agent runtime."""

from __future__ import annotations

import argparse

from continuum_agent import SERVICE_NAME
from continuum_agent.server import start
from continuum_agent.settings import AgentSettings
from continuum_runtime.logs import configure_logging
from continuum_runtime.server import run, serve


async def _serve(settings: AgentSettings) -> None:
    await serve(await start(settings), settings)


def main() -> None:
    """Parse the command, read settings once, run."""
    parser = argparse.ArgumentParser(prog="python -m continuum_agent")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("serve", help="run the gRPC service")
    parser.parse_args()
    settings = AgentSettings()
    configure_logging(settings.log_level, SERVICE_NAME)
    run(_serve(settings))


if __name__ == "__main__":
    main()
