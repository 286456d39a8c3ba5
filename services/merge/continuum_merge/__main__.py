"""`python -m continuum_merge serve|migrate|cleanup`: the service, its migration Job, and the reconciling
cleanup (a CronJob) of packages whose target was deleted or whose operation was cancelled."""

from __future__ import annotations

import argparse
import asyncio
import sys

from continuum_merge import SERVICE_NAME
from continuum_merge.cleanup import reconcile
from continuum_merge.errors import MergeError
from continuum_merge.server import migrate, open_database, open_transcript, start
from continuum_merge.settings import MergeSettings
from continuum_runtime.clock import SystemClock
from continuum_runtime.logs import configure_logging
from continuum_runtime.server import run, serve


async def _serve(settings: MergeSettings) -> None:
    await serve(await start(settings), settings)


async def _cleanup(settings: MergeSettings) -> None:
    database = open_database(settings)
    transcript = open_transcript(settings)
    try:
        found = await reconcile(database, transcript, settings.resolved_package_root(), SystemClock())
    except MergeError as error:
        # An operator's terminal wants the reason, not a traceback; nothing was removed after it.
        sys.stderr.write(f"cleanup failed: {error.message}\n")
        raise SystemExit(1) from error
    finally:
        await transcript.close()
        await database.dispose()
    sys.stdout.write(f"checked {found.packages} package(s); removed {found.removed}\n")


def main() -> None:
    """Parse the command, read settings once, run."""
    parser = argparse.ArgumentParser(prog="python -m continuum_merge")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("serve", help="run the gRPC service")
    commands.add_parser("migrate", help="bring the schema to head")
    commands.add_parser("cleanup", help="remove packages of deleted targets and cancelled operations")
    arguments = parser.parse_args()
    settings = MergeSettings()
    configure_logging(settings.log_level, SERVICE_NAME)
    if arguments.command == "serve":
        run(_serve(settings))
    elif arguments.command == "migrate":
        asyncio.run(migrate(settings))
    else:
        asyncio.run(_cleanup(settings))


if __name__ == "__main__":
    main()
