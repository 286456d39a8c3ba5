"""The ordered table of processes `continuum up` runs. Adding a service is one line in `COMPONENTS`."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class Protocol(enum.Enum):
    """How a component is reached, and therefore how its health is probed."""

    GRPC = "grpc"  # grpc.health.v1 Check of the server's overall status ("").
    HTTP = "http"  # GET /readyz answers 200 once its upstreams are healthy.


@dataclass(frozen=True)
class Component:
    """One process: `python -m <argv...>`, configured only by `<env_prefix>*` environment variables.

    Each component receives `<P>DATA_DIR`, `<P>HOST`, `<P>PORT` and `<P>SERVICE_TOKEN`, plus
    `<P><DEP>_ADDRESS` ("127.0.0.1:<port>") for every name in `depends_on`, `<P>DEV_TOKEN` when
    `dev_token` is set and `<P>PAGE_TOKEN_SECRET` when `signs_page_tokens` is set. It publishes its
    bound port in `<data_dir>/run/<name>.port`.
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

    @property
    def module(self) -> str:
        """The module run with `python -m`."""
        return self.argv[0]

    def variable(self, setting: str) -> str:
        """The environment variable of one of its settings: "SERVICE_TOKEN" -> "TRANSCRIPT_SERVICE_TOKEN"."""
        return f"{self.env_prefix}{setting}"

    def address_variable(self, dependency: str) -> str:
        """The environment variable holding the address of `dependency`: "TRANSCRIPT_ADDRESS" with prefix."""
        return self.variable(f"{dependency.upper()}_ADDRESS")


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
        "compaction",
        ("continuum_compaction", "serve"),
        "COMPACTION_",
        depends_on=("transcript",),
        default_port=50152,
        signs_page_tokens=True,
        migrates=True,
        cleans_up=True,
    ),
    Component(
        "merge",
        ("continuum_merge", "serve"),
        "MERGE_",
        depends_on=("transcript",),
        default_port=50153,
        migrates=True,
        cleans_up=True,
    ),
    Component(
        "gateway",
        ("continuum_gateway",),
        "GATEWAY_",
        depends_on=("transcript", "compaction", "merge"),
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
