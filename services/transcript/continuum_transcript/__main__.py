"""`python -m continuum_transcript serve|migrate`: the service process and its migration Job."""

from __future__ import annotations

import argparse
import asyncio

from continuum_runtime.logs import configure_logging
from continuum_runtime.server import serve_until_signalled, write_port_file
from continuum_transcript import SERVICE_NAME
from continuum_transcript.server import migrate, start
from continuum_transcript.settings import TranscriptSettings


async def _serve(settings: TranscriptSettings) -> None:
    service = await start(settings)
    write_port_file(settings.data_dir, SERVICE_NAME, service.port)
    await serve_until_signalled(service, settings.shutdown_grace_seconds)


def main() -> None:
    """Parse the command, read settings once, run."""
    parser = argparse.ArgumentParser(prog="python -m continuum_transcript")
    parser.add_argument("command", choices=["serve", "migrate"])
    command = parser.parse_args().command
    settings = TranscriptSettings()
    configure_logging(settings.log_level, SERVICE_NAME)
    asyncio.run(_serve(settings) if command == "serve" else migrate(settings))


if __name__ == "__main__":
    main()
