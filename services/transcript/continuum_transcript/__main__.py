"""`python -m continuum_transcript serve|migrate|rebuild-turn-index`: the service process, its
migration Job, and the operator's rebuild of the derived turn index."""

from __future__ import annotations

import argparse
import asyncio
import sys

from continuum_runtime.clock import SystemClock
from continuum_runtime.logs import configure_logging
from continuum_runtime.server import run, serve
from continuum_transcript import SERVICE_NAME, turns
from continuum_transcript.server import migrate, open_database, start
from continuum_transcript.settings import TranscriptSettings


async def _serve(settings: TranscriptSettings) -> None:
    await serve(await start(settings), settings)


async def _rebuild_turn_index(settings: TranscriptSettings, session_id: str | None) -> None:
    database = open_database(settings)
    try:
        rebuilt = await turns.rebuild(database, SystemClock(), session_id)
    finally:
        await database.dispose()
    # A count only: the index holds previews of bodies, which never belong on a terminal or in logs.
    sys.stdout.write(f"rebuilt the turn index of {rebuilt} session(s)\n")


def main() -> None:
    """Parse the command, read settings once, run."""
    parser = argparse.ArgumentParser(prog="python -m continuum_transcript")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("serve", help="run the gRPC service")
    commands.add_parser("migrate", help="bring the schema to head")
    rebuild = commands.add_parser("rebuild-turn-index", help="rebuild the derived turn index from the messages")
    rebuild.add_argument("--session", metavar="ID", help="only this session (default: every session with messages)")
    arguments = parser.parse_args()
    settings = TranscriptSettings()
    configure_logging(settings.log_level, SERVICE_NAME)
    if arguments.command == "serve":
        run(_serve(settings))
    elif arguments.command == "migrate":
        asyncio.run(migrate(settings))
    else:
        asyncio.run(_rebuild_turn_index(settings, arguments.session))


if __name__ == "__main__":
    main()
