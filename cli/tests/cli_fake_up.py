"""`python -m cli_fake_up <data_dir> <startup_timeout> <stop_grace> [name=port ...]`: the real supervisor over fakes.

alpha is a gRPC service that signs page tokens (like transcript); beta is an HTTP front that depends
on it and takes the dev token (like the gateway).
With FAKE_SEED_DEMO=1 the supervisor owes an empty data dir the demo, as `continuum up` does.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from continuum_cli.components import Component, Protocol
from continuum_cli.supervisor import Supervisor

COMPONENTS = (
    Component("alpha", ("cli_fake_component", "alpha", "grpc"), "ALPHA_", signs_page_tokens=True),
    Component(
        "beta",
        ("cli_fake_component", "beta", "http"),
        "BETA_",
        depends_on=("alpha",),
        protocol=Protocol.HTTP,
        dev_token=True,
    ),
)

if __name__ == "__main__":
    data_dir, startup_timeout, stop_grace = Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    ports = {name: int(port) for name, _, port in (arg.partition("=") for arg in sys.argv[4:])}
    supervisor = Supervisor(
        data_dir,
        ports,
        COMPONENTS,
        startup_timeout=startup_timeout,
        stop_grace=stop_grace,
        seed_demo=os.environ.get("FAKE_SEED_DEMO") == "1",
    )
    sys.exit(supervisor.run())
