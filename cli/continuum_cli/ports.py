"""Pre-flight check of fixed ports, so a clash is reported before anything starts."""

from __future__ import annotations

import socket


def port_in_use(host: str, port: int) -> bool:
    """True when `host:port` cannot be bound for listening right now.

    SO_REUSEADDR like the servers themselves, so a port left in TIME_WAIT by a previous run counts as
    free. No SO_REUSEPORT: gRPC servers set it, and a second one would otherwise silently share the
    port with the first (each answering part of the calls from its own database).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return True
    return False
