"""`continuum follow <session>`: print a session live in the terminal until Ctrl-C.

Follow calls carry the service credential, so this is a command for operators who hold the
transcript service token: `$CONTINUUM_SERVICE_TOKEN`, else the one `continuum up` keeps in its data dir.
The transcript address is `--address`, else `$CONTINUUM_TRANSCRIPT_ADDRESS`, else the port the
transcript of the local run in the data dir publishes, else transcript's default port.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import TextIO

from continuum.transcript.v1 import transcript_service_pb2_grpc as api_grpc
from continuum_cli.rundir import RunDir
from continuum_cli.tokens import SERVICE_TOKEN_FILE, read_token
from continuum_follow import FollowClient, FollowError, Renderer
from continuum_runtime.auth import call_metadata
from continuum_runtime.channels import open_channel

ADDRESS_ENV = "CONTINUUM_TRANSCRIPT_ADDRESS"
DEFAULT_ADDRESS = "127.0.0.1:50151"
# The component whose port file names the address in a local run's data dir.
TRANSCRIPT = "transcript"
TOKEN_ENV = "CONTINUUM_SERVICE_TOKEN"
DEFAULT_USER = "dev"
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


def resolve_address(given: str | None, data_dir: Path) -> str:
    """`given`, else $CONTINUUM_TRANSCRIPT_ADDRESS, else the local run's transcript port, else the default port."""
    return given or os.environ.get(ADDRESS_ENV) or RunDir(data_dir).address(TRANSCRIPT) or DEFAULT_ADDRESS


def resolve_token(token_env: str, data_dir: Path) -> str | None:
    """$`token_env`, else the service token of the local run in `data_dir`, else None."""
    return os.environ.get(token_env) or read_token(data_dir / SERVICE_TOKEN_FILE)


def follow(
    session_id: str, *, address: str | None, data_dir: Path, token_env: str, user: str, out: TextIO | None = None
) -> int:
    """Print `session_id` live until Ctrl-C (exit 0); 1 when following is refused, 2 without a token."""
    token = resolve_token(token_env, data_dir)
    if token is None:
        print(
            f"continuum follow: no service token: set {token_env}, or point --data-dir at the data dir of a "
            f"running `continuum up` (no token in {data_dir / SERVICE_TOKEN_FILE}).",
            file=sys.stderr,
        )
        return EXIT_USAGE
    address = resolve_address(address, data_dir)
    try:
        return asyncio.run(_follow(session_id, address, token, user, out or sys.stdout))
    except KeyboardInterrupt:
        # Ctrl-C before the handler below was installed (or where signals can't be handled).
        return EXIT_OK


async def _follow(session_id: str, address: str, token: str, user: str, out: TextIO) -> int:
    channel = open_channel(address)
    client = FollowClient(api_grpc.TranscriptServiceStub(channel), session_id, call_metadata(token, user))
    renderer = Renderer(color=out.isatty())
    loop = asyncio.get_running_loop()
    handled = False
    with contextlib.suppress(NotImplementedError, RuntimeError):
        # Ctrl-C ends following cleanly: the loop finishes and the channel closes.
        loop.add_signal_handler(signal.SIGINT, client.stop)
        handled = True
    try:
        async for update in client.updates():
            _write(out, renderer.render(update))
    except FollowError as error:
        _write(out, renderer.finish())
        print(f"continuum follow: {error}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        if handled:
            loop.remove_signal_handler(signal.SIGINT)
        await channel.close()
    _write(out, renderer.finish())
    return EXIT_OK


def _write(out: TextIO, text: str) -> None:
    if text:
        out.write(text)
        out.flush()
