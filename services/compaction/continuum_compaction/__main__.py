"""`python -m continuum_compaction serve|migrate|cleanup`: the service, its migration Job, and the
reconciling cleanup (a CronJob) for deleted sessions the event consumer missed."""

from __future__ import annotations

import argparse
import asyncio
import sys

from continuum_compaction import SERVICE_NAME
from continuum_compaction.cleanup import reconcile
from continuum_compaction.errors import CompactionError
from continuum_compaction.server import migrate, open_database, open_transcript, start
from continuum_compaction.settings import CompactionSettings
from continuum_runtime.logs import configure_logging
from continuum_runtime.server import run, serve


async def _serve(settings: CompactionSettings) -> None:
    await serve(await start(settings), settings)


async def _cleanup(settings: CompactionSettings) -> None:
    database = open_database(settings)
    transcript = open_transcript(settings)
    try:
        deleted, removed = await reconcile(database, transcript)
    except CompactionError as error:
        # An operator's terminal wants the reason, not a traceback.
        sys.stderr.write(f"cleanup failed: {error.message}\n")
        raise SystemExit(1) from error
    finally:
        await transcript.close()
        await database.dispose()
    sys.stdout.write(f"checked {deleted} deleted-session event(s); removed {removed} compaction row(s)\n")


def main() -> None:
    """Parse the command, read settings once, run."""
    parser = argparse.ArgumentParser(prog="python -m continuum_compaction")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("serve", help="run the gRPC service")
    commands.add_parser("migrate", help="bring the schema to head")
    commands.add_parser("cleanup", help="remove compaction data of deleted sessions the event consumer missed")
    arguments = parser.parse_args()
    settings = CompactionSettings()
    configure_logging(settings.log_level, SERVICE_NAME)
    if arguments.command == "serve":
        run(_serve(settings))
    elif arguments.command == "migrate":
        asyncio.run(migrate(settings))
    else:
        asyncio.run(_cleanup(settings))


if __name__ == "__main__":
    main()
