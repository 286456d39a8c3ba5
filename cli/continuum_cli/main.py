"""Entry point of the `continuum` command: parse arguments and dispatch to one subcommand."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from continuum_cli.components import COMPONENTS, Component, cleanable, migratable
from continuum_cli.datadir import DATA_DIR_HELP, resolve_data_dir
from continuum_cli.follow import ADDRESS_ENV, DEFAULT_ADDRESS, DEFAULT_USER, TOKEN_ENV, follow
from continuum_cli.migrate import cleanup, migrate
from continuum_cli.supervisor import up


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0 meaning any free port."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be between 0 and 65535, got {port}")
    return port


def add_data_dir_option(parser: argparse.ArgumentParser, purpose: str) -> None:
    """`--data-dir DIR`; None when absent (see `resolve_data_dir`)."""
    parser.add_argument("--data-dir", type=Path, default=None, metavar="DIR", help=f"{DATA_DIR_HELP}; {purpose}")


def build_parser(components: Sequence[Component] = COMPONENTS) -> argparse.ArgumentParser:
    """The command line: `up`, `migrate <service>`, `follow <session>` and `cleanup <service>`."""
    parser = argparse.ArgumentParser(
        prog="continuum", description="Run and operate Continuum: transcripts, compaction, merges."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up_parser = commands.add_parser("up", help="run every service locally until Ctrl-C")
    add_data_dir_option(up_parser, "where databases, run files, logs and tokens live")
    # One option per component, so a new table entry gets its port option for free.
    for component in components:
        up_parser.add_argument(
            f"--{component.name}-port",
            dest=f"port_{component.name}",
            type=port_number,
            default=component.default_port,
            metavar="N",
            help=f"port of {component.name} (default: {component.default_port}; 0 = any free port)",
        )

    services = sorted(migratable(components))
    migrate_parser = commands.add_parser("migrate", help="run one service's database migrations and exit")
    migrate_parser.add_argument("service", choices=services, help=f"one of: {', '.join(services)}")

    follow_parser = commands.add_parser(
        "follow", help="print a session live until Ctrl-C (for operators holding the service token)"
    )
    follow_parser.add_argument("session_id", help="the session to follow")
    add_data_dir_option(follow_parser, "its service token and transcript port are used when not given otherwise")
    follow_parser.add_argument(
        "--address",
        default=None,
        metavar="HOST:PORT",
        help=f"the transcript service (default: ${ADDRESS_ENV}, else the port transcript publishes in the data "
        f"dir, else {DEFAULT_ADDRESS})",
    )
    follow_parser.add_argument(
        "--token-env",
        default=TOKEN_ENV,
        metavar="NAME",
        help=f"environment variable holding the transcript service token (default: {TOKEN_ENV}); "
        "when unset, the token `continuum up` keeps in the data dir",
    )
    follow_parser.add_argument(
        "--user", default=DEFAULT_USER, help=f"the user who owns the session (default: {DEFAULT_USER})"
    )

    cleaned = sorted(cleanable(components))
    cleanup_parser = commands.add_parser(
        "cleanup",
        help="remove what one service still holds for deleted sessions, and exit (configured by its own env vars)",
    )
    cleanup_parser.add_argument("service", choices=cleaned, help=f"one of: {', '.join(cleaned)}")
    add_data_dir_option(
        cleanup_parser,
        "supplies the service's data dir and, while `continuum up` runs there, its token and addresses "
        "(the service's own <PREFIX>* variables win)",
    )
    return parser


def main(argv: Sequence[str] | None = None, components: Sequence[Component] = COMPONENTS) -> int:
    """Run the command line `argv` (default: sys.argv[1:]); the process exit code."""
    args = build_parser(components).parse_args(argv)
    if args.command == "migrate":
        return migrate(migratable(components)[args.service])
    data_dir = resolve_data_dir(args.data_dir)
    if args.command == "up":
        ports = {component.name: getattr(args, f"port_{component.name}") for component in components}
        return up(data_dir, ports, components)
    if args.command == "follow":
        return follow(
            args.session_id, address=args.address, data_dir=data_dir, token_env=args.token_env, user=args.user
        )
    # argparse accepts nothing else; only `cleanup` remains.
    return cleanup(cleanable(components)[args.service], data_dir)
