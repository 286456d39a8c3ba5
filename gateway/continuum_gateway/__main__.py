"""`python -m continuum_gateway`: serve the gateway with uvicorn until SIGINT or SIGTERM.

Binds `GATEWAY_HOST:GATEWAY_PORT` (port 0 picks a free one) and, once listening, publishes the bound
port in `<GATEWAY_DATA_DIR>/run/gateway.port` for a supervisor such as `continuum up`.

WebSockets (the Follow route) run on uvicorn's websockets sans-I/O protocol, which pings every socket
each `GATEWAY_WS_PING_INTERVAL_SECONDS` and drops one whose pong does not come within
`GATEWAY_WS_PING_TIMEOUT_SECONDS`, and whose sends wait while a browser does not read (the
backpressure Follow's overflow detection relies on). Frames are sent uncompressed (no
permessage-deflate; see `uvicorn_config`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import uvicorn
from starlette.types import ASGIApp

from continuum_gateway import SERVICE_NAME
from continuum_gateway.app import create_app
from continuum_gateway.settings import GatewaySettings
from continuum_runtime.logs import configure_logging
from continuum_runtime.server import write_port_file

logger = logging.getLogger("continuum.gateway")


class GatewayServer(uvicorn.Server):
    """uvicorn's server, writing the port file once bound and leaving signals to `serve`."""

    def __init__(self, config: uvicorn.Config, data_dir: Path) -> None:
        super().__init__(config)
        self.data_dir = data_dir
        self.port: int | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Install nothing: uvicorn re-raises a captured signal after shutting down, which would end
        the process with KeyboardInterrupt instead of exit status 0. `serve` handles signals."""
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """Start listening, then publish the bound port (atomically, via the runtime's helper)."""
        await super().startup(sockets=sockets)
        if not self.started:
            return
        listening = self.servers[0].sockets
        self.port = int(listening[0].getsockname()[1])
        write_port_file(self.data_dir, SERVICE_NAME, self.port)
        logger.info("gateway started", extra={"service": SERVICE_NAME, "port": self.port})

    def request_exit(self) -> None:
        """First signal: drain and stop. Second: stop without waiting for requests in flight."""
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True


def uvicorn_config(settings: GatewaySettings, app: ASGIApp | None = None) -> uvicorn.Config:
    """How uvicorn serves the gateway (`app`, by default `create_app(settings)`)."""
    return uvicorn.Config(
        app if app is not None else create_app(settings),
        host=settings.host,
        port=settings.port,
        lifespan="on",
        # Logging is configured by `configure_logging`; the gateway writes its own access log.
        log_config=None,
        access_log=False,
        server_header=False,
        timeout_graceful_shutdown=settings.shutdown_grace_seconds,
        # Named rather than "auto", so ping and backpressure behaviour do not depend on what is installed.
        ws="websockets-sansio",
        ws_ping_interval=settings.ws_ping_interval_seconds,
        ws_ping_timeout=settings.ws_ping_timeout_seconds,
        ws_max_size=settings.ws_max_message_bytes,
        # No permessage-deflate: Follow frames are small JSON texts (a chunk is a few dozen
        # characters), on loopback or a LAN behind a proxy; compressing each one for each browser
        # cost about 13% of the gateway's CPU per frame while saving next to no bandwidth.
        # Browsers still offer the extension; the handshake simply does not accept it.
        ws_per_message_deflate=False,
    )


async def serve(settings: GatewaySettings) -> None:
    """Run the gateway until SIGINT or SIGTERM, then shut down gracefully."""
    server = GatewayServer(uvicorn_config(settings), settings.data_dir)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, server.request_exit)
    try:
        await server.serve()
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    logger.info("gateway stopped", extra={"service": SERVICE_NAME})


def main() -> None:
    """Read settings once, configure logging, serve."""
    settings = GatewaySettings()
    configure_logging(settings.log_level, SERVICE_NAME)
    # uvicorn's own info lines duplicate ours (and carry ANSI-coloured copies); keep its warnings.
    # Never lower this: at DEBUG the WebSocket protocol logs handshake headers, whose
    # Sec-WebSocket-Protocol carries the browser's bearer credential.
    logging.getLogger("uvicorn").setLevel(logging.WARNING)
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
