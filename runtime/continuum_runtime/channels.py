"""Client channels to Continuum services, with the same message limits and keepalive as servers."""

from __future__ import annotations

import grpc

from continuum_runtime.server import keepalive_options

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def open_channel(address: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> grpc.aio.Channel:
    """An insecure grpc.aio channel (TLS terminates at the mesh/ingress) to `host:port`."""
    return grpc.aio.insecure_channel(address, options=keepalive_options(max_message_bytes))
