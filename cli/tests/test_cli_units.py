"""The `continuum` command's parts that need no running process: arguments, table, tokens, run files."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

from continuum_agent.settings import AgentSettings
from continuum_cli.components import COMPONENTS, Component, Protocol, check_order, cleanable, migratable
from continuum_cli.datadir import resolve_data_dir
from continuum_cli.follow import follow, resolve_address, resolve_token
from continuum_cli.main import build_parser, main
from continuum_cli.migrate import local_env
from continuum_cli.ports import port_in_use
from continuum_cli.rundir import RunDir
from continuum_cli.supervisor import component_env, describe_exit
from continuum_cli.tokens import load_or_create_dev_token, load_or_create_page_token_secret, write_service_token
from continuum_compaction.settings import CompactionSettings
from continuum_gateway.settings import GatewaySettings
from continuum_handoff_read.settings import HandoffReadSettings
from continuum_merge.settings import MergeSettings
from continuum_transcript.settings import TranscriptSettings

HERE = Path(__file__).parent

# The table by name: its order is checked by one test, not assumed by the others.
COMPONENT = {component.name: component for component in COMPONENTS}


def test_up_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONTINUUM_DATA_DIR", raising=False)
    args = build_parser().parse_args(["up"])

    assert resolve_data_dir(args.data_dir) == Path(".continuum")
    assert args.port_gateway == 8080
    assert args.port_transcript == 50151
    assert args.port_compaction == 50152
    assert args.port_merge == 50153


def test_up_options() -> None:
    args = build_parser().parse_args(
        [
            "up",
            "--data-dir",
            "/x",
            "--gateway-port",
            "0",
            "--transcript-port",
            "7",
            "--compaction-port",
            "8",
            "--merge-port",
            "9",
        ]
    )

    assert (args.data_dir, args.port_gateway, args.port_transcript, args.port_compaction, args.port_merge) == (
        Path("/x"),
        0,
        7,
        8,
        9,
    )


@pytest.mark.parametrize("command", [["up"], ["follow", "s1"], ["cleanup", "compaction"]])
def test_the_data_dir_is_the_option_else_the_environment_else_dot_continuum(
    command: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CONTINUUM_DATA_DIR", raising=False)
    assert resolve_data_dir(build_parser().parse_args(command).data_dir) == Path(".continuum")

    monkeypatch.setenv("CONTINUUM_DATA_DIR", "/from/env")
    assert resolve_data_dir(build_parser().parse_args(command).data_dir) == Path("/from/env")
    assert resolve_data_dir(build_parser().parse_args([*command, "--data-dir", "/given"]).data_dir) == Path("/given")


@pytest.mark.parametrize("port", ["-1", "65536", "eighty"])
def test_bad_port_is_a_usage_error(port: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["up", "--gateway-port", port])

    assert exit_info.value.code == 2
    assert "--gateway-port" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "valid"), [("migrate", "'compaction', 'merge', 'transcript'"), ("cleanup", "'compaction', 'merge'")]
)
def test_an_unknown_service_is_a_usage_error_naming_the_valid_ones(
    command: str, valid: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "gateway"])

    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"invalid choice: 'gateway' (choose from {valid})" in err


def test_the_table_starts_the_services_then_the_gateway_that_needs_them() -> None:
    check_order(COMPONENTS)
    transcript, merge, handoff_read, compaction, agent, gateway = COMPONENTS

    assert (transcript.name, transcript.argv, transcript.env_prefix) == (
        "transcript",
        ("continuum_transcript", "serve"),
        "TRANSCRIPT_",
    )
    assert transcript.protocol is Protocol.GRPC
    assert (compaction.name, compaction.argv, compaction.env_prefix) == (
        "compaction",
        ("continuum_compaction", "serve"),
        "COMPACTION_",
    )
    assert (compaction.protocol, compaction.depends_on, compaction.default_port) == (
        Protocol.GRPC,
        ("transcript", "handoff-read"),
        50152,
    )
    assert (merge.name, merge.argv, merge.env_prefix) == ("merge", ("continuum_merge", "serve"), "MERGE_")
    assert (merge.protocol, merge.depends_on, merge.default_port) == (Protocol.GRPC, ("transcript",), 50153)
    assert (handoff_read.name, handoff_read.argv, handoff_read.env_prefix) == (
        "handoff-read",
        ("continuum_handoff_read", "serve"),
        "HANDOFF_READ_",
    )
    assert (handoff_read.protocol, handoff_read.depends_on, handoff_read.default_port) == (
        Protocol.GRPC,
        ("transcript", "merge"),
        50155,
    )
    assert not handoff_read.migrates and not handoff_read.cleans_up and not handoff_read.dev_token
    assert (gateway.name, gateway.argv, gateway.env_prefix) == ("gateway", ("continuum_gateway",), "GATEWAY_")
    assert (agent.name, agent.argv, agent.env_prefix) == ("agent", ("continuum_agent", "serve"), "AGENT_")
    assert (agent.protocol, agent.depends_on, agent.default_port) == (
        Protocol.GRPC,
        ("transcript", "handoff-read", "compaction"),
        50154,
    )
    assert not agent.dev_token and not agent.migrates and not agent.signs_page_tokens
    assert (gateway.name, gateway.argv, gateway.env_prefix) == ("gateway", ("continuum_gateway",), "GATEWAY_")
    assert gateway.depends_on == ("transcript", "compaction", "agent", "merge")
    assert gateway.protocol is Protocol.HTTP
    assert gateway.dev_token
    assert not transcript.dev_token
    assert not compaction.dev_token
    assert not merge.dev_token
    assert set(migratable()) == {"transcript", "compaction", "merge"}
    assert set(cleanable()) == {"compaction", "merge"}


@pytest.mark.parametrize(
    ("component", "settings"),
    [
        (COMPONENT["transcript"], TranscriptSettings),
        (COMPONENT["compaction"], CompactionSettings),
        (COMPONENT["merge"], MergeSettings),
        (COMPONENT["handoff-read"], HandoffReadSettings),
        (COMPONENT["agent"], AgentSettings),
        (COMPONENT["gateway"], GatewaySettings),
    ],
)
def test_every_variable_up_sets_is_a_setting_of_the_component(
    component: Component, settings: type[BaseSettings], tmp_path: Path
) -> None:
    env = component_env(
        component,
        data_dir=tmp_path,
        port=0,
        service_token="service",
        dev_token="dev",
        page_token_secret="secret",
        addresses={name: "127.0.0.1:5" for name in component.depends_on},
    )

    fields = {name.removeprefix(component.env_prefix).lower() for name in env}
    known = set(settings.model_fields)
    assert fields <= known, fields - known
    assert settings.model_config.get("env_prefix") == component.env_prefix


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ((Component("a", ("m",), "A_", depends_on=("b",)), Component("b", ("m",), "B_")), "must be listed before"),
        ((Component("a", ("m",), "A_"), Component("a", ("m",), "A_")), "listed twice"),
    ],
)
def test_the_table_rejects_bad_orders(table: tuple[Component, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_order(table)


def test_the_gateway_env_names_every_upstream_address_and_the_dev_token(tmp_path: Path) -> None:
    gateway = COMPONENT["gateway"]

    env = component_env(
        gateway,
        data_dir=tmp_path,
        port=0,
        service_token="service",
        dev_token="dev",
        page_token_secret="secret",
        addresses={
            "transcript": "127.0.0.1:5",
            "compaction": "127.0.0.1:6",
            "agent": "127.0.0.1:7",
            "merge": "127.0.0.1:8",
        },
    )

    assert env == {
        "GATEWAY_DATA_DIR": str(tmp_path),
        "GATEWAY_HOST": "127.0.0.1",
        "GATEWAY_PORT": "0",
        "GATEWAY_SERVICE_TOKEN": "service",
        "GATEWAY_TRANSCRIPT_ADDRESS": "127.0.0.1:5",
        "GATEWAY_COMPACTION_ADDRESS": "127.0.0.1:6",
        "GATEWAY_AGENT_ADDRESS": "127.0.0.1:7",
        "GATEWAY_MERGE_ADDRESS": "127.0.0.1:8",
        "GATEWAY_DEV_TOKEN": "dev",
    }


def test_the_merge_env_names_transcript_the_page_token_secret_and_its_package_root(tmp_path: Path) -> None:
    env = component_env(
        COMPONENT["merge"],
        data_dir=tmp_path,
        port=50153,
        service_token="service",
        dev_token="dev",
        page_token_secret="secret",
        addresses={"transcript": "127.0.0.1:5"},
    )

    assert env == {
        "MERGE_DATA_DIR": str(tmp_path),
        "MERGE_HOST": "127.0.0.1",
        "MERGE_PORT": "50153",
        "MERGE_SERVICE_TOKEN": "service",
        "MERGE_PACKAGE_ROOT": str(tmp_path / "merge-packages"),
        "MERGE_TRANSCRIPT_ADDRESS": "127.0.0.1:5",
        "MERGE_PAGE_TOKEN_SECRET": "secret",
    }


def test_the_handoff_read_env_names_transcript_merge_the_secret_and_merges_package_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = component_env(
        COMPONENT["handoff-read"],
        data_dir=tmp_path,
        port=50155,
        service_token="service",
        dev_token="dev",
        page_token_secret="secret",
        addresses={"transcript": "127.0.0.1:5", "merge": "127.0.0.1:6"},
    )

    assert env == {
        "HANDOFF_READ_DATA_DIR": str(tmp_path),
        "HANDOFF_READ_HOST": "127.0.0.1",
        "HANDOFF_READ_PORT": "50155",
        "HANDOFF_READ_SERVICE_TOKEN": "service",
        "HANDOFF_READ_PACKAGE_ROOT": str(tmp_path / "merge-packages"),
        "HANDOFF_READ_TRANSCRIPT_ADDRESS": "127.0.0.1:5",
        "HANDOFF_READ_MERGE_ADDRESS": "127.0.0.1:6",
        "HANDOFF_READ_PAGE_TOKEN_SECRET": "secret",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert HandoffReadSettings().resolved_package_root() == (tmp_path / "merge-packages").resolve()


def test_the_compaction_env_names_transcript_handoff_read_and_the_page_token_secret(tmp_path: Path) -> None:
    env = component_env(
        COMPONENT["compaction"],
        data_dir=tmp_path,
        port=50152,
        service_token="service",
        dev_token="dev",
        page_token_secret="secret",
        addresses={"transcript": "127.0.0.1:5", "handoff-read": "127.0.0.1:7"},
    )

    assert env == {
        "COMPACTION_DATA_DIR": str(tmp_path),
        "COMPACTION_HOST": "127.0.0.1",
        "COMPACTION_PORT": "50152",
        "COMPACTION_SERVICE_TOKEN": "service",
        "COMPACTION_TRANSCRIPT_ADDRESS": "127.0.0.1:5",
        "COMPACTION_HANDOFF_READ_ADDRESS": "127.0.0.1:7",
        "COMPACTION_PAGE_TOKEN_SECRET": "secret",
    }


def test_the_transcript_env_carries_the_page_token_secret(tmp_path: Path) -> None:
    env = component_env(
        COMPONENTS[0],
        data_dir=tmp_path,
        port=50151,
        service_token="service",
        dev_token="dev",
        page_token_secret="secret",
        addresses={},
    )

    assert env == {
        "TRANSCRIPT_DATA_DIR": str(tmp_path),
        "TRANSCRIPT_HOST": "127.0.0.1",
        "TRANSCRIPT_PORT": "50151",
        "TRANSCRIPT_SERVICE_TOKEN": "service",
        "TRANSCRIPT_PAGE_TOKEN_SECRET": "secret",
    }


def test_describe_exit() -> None:
    assert describe_exit(3) == "code 3"
    assert describe_exit(-9) == "signal SIGKILL"


def test_dev_token_is_created_private_and_then_reused(tmp_path: Path) -> None:
    token = load_or_create_dev_token(tmp_path)

    assert len(token) >= 32
    assert (tmp_path / "dev-token").stat().st_mode & 0o777 == 0o600
    assert load_or_create_dev_token(tmp_path) == token


def test_a_readable_dev_token_file_is_made_private(tmp_path: Path) -> None:
    path = tmp_path / "dev-token"
    path.write_text("my-own-token\n")
    path.chmod(0o644)

    assert load_or_create_dev_token(tmp_path) == "my-own-token"
    assert path.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("content", ["", "\n", "two words", "bad\x00byte"])
def test_an_unusable_dev_token_file_is_replaced(tmp_path: Path, content: str) -> None:
    (tmp_path / "dev-token").write_text(content)

    token = load_or_create_dev_token(tmp_path)

    assert token != content.strip()
    assert (tmp_path / "dev-token").read_text().strip() == token


def test_the_page_token_secret_is_created_private_and_then_reused(tmp_path: Path) -> None:
    secret = load_or_create_page_token_secret(tmp_path)

    assert len(secret) >= 32
    assert (tmp_path / "page-token-secret").stat().st_mode & 0o777 == 0o600
    assert load_or_create_page_token_secret(tmp_path) == secret
    assert secret != load_or_create_dev_token(tmp_path)


def test_the_service_token_is_written_private_replacing_the_last_one(tmp_path: Path) -> None:
    path = tmp_path / "service-token"
    path.write_text("last-run\n")
    path.chmod(0o644)

    assert write_service_token(tmp_path, "this-run") == path
    assert path.read_text() == "this-run\n"
    assert path.stat().st_mode & 0o777 == 0o600


def _local_run(data_dir: Path, ports: dict[str, int]) -> None:
    """What a running `continuum up` leaves in its data dir: the two secrets and its port files."""
    RunDir(data_dir).create()
    write_service_token(data_dir, "run-token")
    (data_dir / "page-token-secret").write_text("run-secret\n")
    for name, port in ports.items():
        (data_dir / "run" / f"{name}.port").write_text(f"{port}\n")


def test_a_local_runs_data_dir_configures_a_maintenance_command(tmp_path: Path) -> None:
    _local_run(tmp_path, {"transcript": 4001})

    env = local_env(COMPONENT["compaction"], tmp_path, {"PATH": "/bin"})

    assert env == {
        "PATH": "/bin",
        "COMPACTION_DATA_DIR": str(tmp_path.resolve()),
        "COMPACTION_SERVICE_TOKEN": "run-token",
        "COMPACTION_PAGE_TOKEN_SECRET": "run-secret",
        "COMPACTION_TRANSCRIPT_ADDRESS": "127.0.0.1:4001",
    }


def test_the_operators_own_variables_win_over_the_data_dir(tmp_path: Path) -> None:
    _local_run(tmp_path, {"transcript": 4001})
    own = {
        "COMPACTION_DATA_DIR": "/mine",
        "COMPACTION_SERVICE_TOKEN": "mine",
        "COMPACTION_PAGE_TOKEN_SECRET": "my-secret",
        "COMPACTION_TRANSCRIPT_ADDRESS": "db:1",
    }

    assert local_env(COMPONENT["compaction"], tmp_path, own) == own


def test_a_data_dir_without_a_run_supplies_only_itself(tmp_path: Path) -> None:
    assert local_env(COMPONENT["compaction"], tmp_path / "none", {}) == {
        "COMPACTION_DATA_DIR": str((tmp_path / "none").resolve())
    }


def test_a_data_dir_supplies_the_directories_a_component_keeps_in_it(tmp_path: Path) -> None:
    _local_run(tmp_path, {"transcript": 4001})

    env = local_env(COMPONENT["merge"], tmp_path, {})

    assert env["MERGE_DATA_DIR"] == str(tmp_path.resolve())
    assert env["MERGE_PACKAGE_ROOT"] == str(tmp_path.resolve() / "merge-packages")
    assert env["MERGE_TRANSCRIPT_ADDRESS"] == "127.0.0.1:4001"


def test_follow_finds_token_and_address_in_the_data_dir_unless_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CONTINUUM_SERVICE_TOKEN", raising=False)
    monkeypatch.delenv("CONTINUUM_TRANSCRIPT_ADDRESS", raising=False)
    assert resolve_token("CONTINUUM_SERVICE_TOKEN", tmp_path) is None
    assert resolve_address(None, tmp_path) == "127.0.0.1:50151"

    _local_run(tmp_path, {"transcript": 4001})
    assert resolve_token("CONTINUUM_SERVICE_TOKEN", tmp_path) == "run-token"
    assert resolve_address(None, tmp_path) == "127.0.0.1:4001"

    monkeypatch.setenv("CONTINUUM_SERVICE_TOKEN", "mine")
    monkeypatch.setenv("CONTINUUM_TRANSCRIPT_ADDRESS", "env:2")
    assert resolve_token("CONTINUUM_SERVICE_TOKEN", tmp_path) == "mine"
    assert resolve_address(None, tmp_path) == "env:2"
    assert resolve_address("given:3", tmp_path) == "given:3"


def test_follow_without_any_token_says_where_it_looked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("CONTINUUM_SERVICE_TOKEN", raising=False)

    code = follow("s1", address=None, data_dir=tmp_path, token_env="CONTINUUM_SERVICE_TOKEN", user="dev")

    assert code == 2
    err = capsys.readouterr().err
    assert "set CONTINUUM_SERVICE_TOKEN" in err
    assert str(tmp_path / "service-token") in err


def test_stale_run_files_are_removed_and_others_kept(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    run_dir.create()
    for name in ("transcript.port", "transcript.pid", "transcript.tmp", "gateway.port", "other.port"):
        (tmp_path / "run" / name).write_text("1")

    run_dir.remove_stale(["transcript", "gateway"])

    assert sorted(path.name for path in (tmp_path / "run").iterdir()) == ["other.port"]


@pytest.mark.parametrize(("content", "port"), [("50151\n", 50151), ("", None), ("12ab", None), ("0", None)])
def test_read_port(tmp_path: Path, content: str, port: int | None) -> None:
    run_dir = RunDir(tmp_path)
    run_dir.create()
    assert run_dir.read_port("transcript") is None
    (tmp_path / "run" / "transcript.port").write_text(content)

    assert run_dir.read_port("transcript") == port


def _maintenance(arguments: list[str], tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    """`continuum <arguments>` over fake services alpha and beta (beta depends on alpha), run in `tmp_path`;
    a service command it runs records its argv and env in `tmp_path / "record.json"`."""
    record = tmp_path / "record.json"
    program = (
        "import sys\n"
        "from continuum_cli.components import Component\n"
        "from continuum_cli.main import main\n"
        "alpha = Component('alpha', ('cli_fake_component', 'alpha', 'grpc'), 'ALPHA_', migrates=True, cleans_up=True)\n"
        "beta = Component('beta', ('cli_fake_component', 'beta', 'grpc'), 'BETA_', depends_on=('alpha',),\n"
        "                 signs_page_tokens=True, cleans_up=True)\n"
        f"sys.exit(main({arguments!r}, components=(alpha, beta)))\n"
    )
    inherited = {key: value for key, value in os.environ.items() if not key.startswith(("CONTINUUM_", "FAKE_"))}
    env = {**inherited, "PYTHONPATH": str(HERE), "FAKE_COMMAND_RECORD": str(record), "FAKE_COMMAND_EXIT": "5", **env}

    return subprocess.run([sys.executable, "-c", program], env=env, cwd=tmp_path, capture_output=True, timeout=30)


def _run_maintenance(arguments: list[str], tmp_path: Path, env: dict[str, str]) -> tuple[int, dict[str, object]]:
    """`_maintenance` that ran its service command: the exit code and what the command recorded."""
    result = _maintenance(arguments, tmp_path, env)
    recorded: dict[str, object] = json.loads((tmp_path / "record.json").read_text())
    return result.returncode, recorded


def test_migrate_runs_the_service_module_with_the_inherited_env_and_exits_with_its_code(tmp_path: Path) -> None:
    code, record = _run_maintenance(["migrate", "alpha"], tmp_path, {"ALPHA_DATA_DIR": "/somewhere"})

    assert code == 5
    assert record == {"argv": ["migrate"], "env": {"ALPHA_DATA_DIR": "/somewhere"}}


def test_cleanup_runs_the_service_module_with_the_inherited_env_and_exits_with_its_code(tmp_path: Path) -> None:
    code, record = _run_maintenance(["cleanup", "alpha"], tmp_path, {"ALPHA_DATA_DIR": "/somewhere"})

    assert code == 5
    assert record == {"argv": ["cleanup"], "env": {"ALPHA_DATA_DIR": "/somewhere"}}


@pytest.mark.parametrize("how", ["option", "environment", "default"])
def test_cleanup_is_configured_by_the_local_run_in_the_data_dir(tmp_path: Path, how: str) -> None:
    data_dir = tmp_path / ".continuum" if how == "default" else tmp_path / "data"
    _local_run(data_dir, {"alpha": 4001})
    arguments = ["cleanup", "beta"] + (["--data-dir", str(data_dir)] if how == "option" else [])
    env = {"CONTINUUM_DATA_DIR": str(data_dir)} if how == "environment" else {}

    code, record = _run_maintenance(arguments, tmp_path, env)

    assert code == 5
    assert record == {
        "argv": ["cleanup"],
        "env": {
            "BETA_DATA_DIR": str(data_dir.resolve()),
            "BETA_SERVICE_TOKEN": "run-token",
            "BETA_PAGE_TOKEN_SECRET": "run-secret",
            "BETA_ALPHA_ADDRESS": "127.0.0.1:4001",
        },
    }


@pytest.mark.parametrize("env", [{}, {"ALPHA_DATABASE_URL": ""}], ids=["unset", "empty"])
def test_cleanup_without_a_data_dir_or_an_environment_placing_the_data_is_refused(
    tmp_path: Path, env: dict[str, str]
) -> None:
    """Run from the wrong directory, the service would create an empty database and report success."""
    result = _maintenance(["cleanup", "alpha"], tmp_path, env)

    assert result.returncode == 2
    assert b"no data dir at .continuum" in result.stderr
    assert b"--data-dir DIR" in result.stderr and b"ALPHA_DATABASE_URL" in result.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == [], "nothing created, no service command run"


def test_a_listening_port_is_in_use_and_a_closed_one_is_not() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]

        assert port_in_use("127.0.0.1", port)

    assert not port_in_use("127.0.0.1", port)
