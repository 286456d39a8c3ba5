"""The ordered table of processes `continuum up` runs. Adding a service is one line in `COMPONENTS`."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


class Protocol(enum.Enum):
    """How a component is reached, and therefore how its health is probed."""

    GRPC = "grpc"  # grpc.health.v1 Check of the server's overall status ("").
    HTTP = "http"  # GET /readyz answers 200 once its upstreams are healthy.


@dataclass(frozen=True)
class Component:
    """One process: `python -m <argv...>`, configured only by `<env_prefix>*` environment variables.

    Each component receives `<P>DATA_DIR`, `<P>HOST`, `<P>PORT` and `<P>SERVICE_TOKEN`, plus
    `<P><DEP>_ADDRESS` ("127.0.0.1:<port>") for every name in `depends_on`, `<P>DEV_TOKEN` when
    `dev_token` is set, `<P>PAGE_TOKEN_SECRET` when `signs_page_tokens` is set, and `<P><SETTING>`
    = `<data_dir>/<directory>` for every (setting, directory) of `data_directories`. It publishes
    its bound port in `<data_dir>/run/<name>.port`.
    """

    name: str
    argv: tuple[str, ...]
    env_prefix: str
    depends_on: tuple[str, ...] = ()
    protocol: Protocol = Protocol.GRPC
    # What `continuum up` binds unless told otherwise; 0 lets the OS choose.
    default_port: int = 0
    # Browser-facing components accept the local developer's bearer token.
    dev_token: bool = False
    # Services sign the page tokens they issue with the deployment's page-token secret.
    signs_page_tokens: bool = False
    # `python -m <module> migrate` exists (what `continuum migrate <name>` runs).
    migrates: bool = False
    # `python -m <module> cleanup` exists (what `continuum cleanup <name>` runs).
    cleans_up: bool = False
    # Settings naming a directory the component keeps inside the data dir: (setting, directory name).
    data_directories: tuple[tuple[str, str], ...] = ()

    @property
    def module(self) -> str:
        """The module run with `python -m`."""
        return self.argv[0]

    def variable(self, setting: str) -> str:
        """The environment variable of one of its settings: "SERVICE_TOKEN" -> "TRANSCRIPT_SERVICE_TOKEN"."""
        return f"{self.env_prefix}{setting}"

    def address_variable(self, dependency: str) -> str:
        """The environment variable holding the address of `dependency`: "TRANSCRIPT_ADDRESS" with prefix
        ("handoff-read" -> "HANDOFF_READ_ADDRESS")."""
        return self.variable(f"{dependency.upper().replace('-', '_')}_ADDRESS")

    def directory_env(self, data_dir: Path) -> dict[str, str]:
        """The variables placing its `data_directories` inside `data_dir`."""
        return {self.variable(setting): str(data_dir / name) for setting, name in self.data_directories}


# Started in this order, stopped in the reverse order; a component may only depend on earlier ones.
COMPONENTS: tuple[Component, ...] = (
    Component(
        "transcript",
        ("continuum_transcript", "serve"),
        "TRANSCRIPT_",
        default_port=50151,
        signs_page_tokens=True,
        migrates=True,
    ),
    Component(
        "merge",
        ("continuum_merge", "serve"),
        "MERGE_",
        depends_on=("transcript",),
        default_port=50153,
        signs_page_tokens=True,
        migrates=True,
        cleans_up=True,
        # The sealed packages of its operations (`<package root>/<operation id>/`).
        data_directories=(("PACKAGE_ROOT", "merge-packages"),),
    ),
    # Read-only access to merge's packages for merged sessions; it signs its cursors with the
    # deployment's page-token secret.
    Component(
        "handoff-read",
        ("continuum_handoff_read", "serve"),
        "HANDOFF_READ_",
        depends_on=("transcript", "merge"),
        default_port=50155,
        signs_page_tokens=True,
        data_directories=(("PACKAGE_ROOT", "merge-packages"),),
    ),
    Component(
        "compaction",
        ("continuum_compaction", "serve"),
        "COMPACTION_",
        depends_on=("transcript", "handoff-read"),
        default_port=50152,
        signs_page_tokens=True,
        migrates=True,
        cleans_up=True,
    ),
    # The reference agent runtime: a client of transcript and compaction that runs users' turns, and of
    # handoff-read for the HandoffRead calls of merged sessions.
    Component(
        "agent",
        ("continuum_agent", "serve"),
        "AGENT_",
        depends_on=("transcript", "handoff-read", "compaction"),
        default_port=50154,
    ),
    Component(
        "gateway",
        ("continuum_gateway",),
        "GATEWAY_",
        depends_on=("transcript", "compaction", "agent", "merge"),
        protocol=Protocol.HTTP,
        default_port=8080,
        dev_token=True,
    ),
)


def check_order(components: Sequence[Component]) -> None:
    """Raise ValueError unless names are unique and every dependency comes earlier in the table."""
    seen: set[str] = set()
    for component in components:
        if component.name in seen:
            raise ValueError(f"component {component.name!r} is listed twice")
        missing = [dep for dep in component.depends_on if dep not in seen]
        if missing:
            raise ValueError(f"component {component.name!r} depends on {missing} which must be listed before it")
        seen.add(component.name)


def migratable(components: Sequence[Component] = COMPONENTS) -> dict[str, Component]:
    """The components `continuum migrate` accepts, by name."""
    return {component.name: component for component in components if component.migrates}


def cleanable(components: Sequence[Component] = COMPONENTS) -> dict[str, Component]:
    """The components `continuum cleanup` accepts, by name."""
    return {component.name: component for component in components if component.cleans_up}
