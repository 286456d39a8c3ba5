"""The Kubernetes manifests, checked offline: well-formed, commands that exist, settings that exist."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel
from pydantic_settings import BaseSettings

from continuum_cli.main import build_parser
from continuum_compaction.settings import CompactionSettings
from continuum_gateway.settings import GatewaySettings
from continuum_transcript.settings import TranscriptSettings

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
K8S = DEPLOY / "k8s"
SETTINGS: dict[str, type[BaseSettings]] = {
    "TRANSCRIPT_": TranscriptSettings,
    "COMPACTION_": CompactionSettings,
    "GATEWAY_": GatewaySettings,
}


def _documents() -> list[dict[str, Any]]:
    found = []
    for path in sorted(K8S.glob("*.yaml")):
        found += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


def _pod_spec(document: dict[str, Any]) -> dict[str, Any]:
    """The pod template's spec of a Deployment or Job, or of the Jobs a CronJob creates; {} otherwise."""
    spec = document.get("spec", {})
    if "jobTemplate" in spec:
        spec = spec["jobTemplate"]["spec"]
    return dict(spec["template"]["spec"]) if "template" in spec else {}


def _containers(document: dict[str, Any]) -> list[dict[str, Any]]:
    return list(_pod_spec(document).get("containers", []))


def _named(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in _documents() if d["kind"] == kind}


def _is_setting(settings: type[BaseModel], field: str) -> bool:
    """`field` (e.g. ``port``, or ``provider__api_key`` for a nested model) names a setting."""
    name, _, rest = field.partition("__")
    if name not in settings.model_fields:
        return False
    if not rest:
        return True
    nested = settings.model_fields[name].annotation
    return isinstance(nested, type) and issubclass(nested, BaseModel) and _is_setting(nested, rest)


def test_every_document_has_the_basic_shape() -> None:
    documents = _documents()
    assert {d["kind"] for d in documents} >= {"Deployment", "Service", "Job", "CronJob"}
    for document in documents:
        assert document["apiVersion"] and document["metadata"]["name"]


@pytest.mark.parametrize("document", _documents(), ids=lambda d: f"{d['kind']}-{d['metadata']['name']}")
def test_commands_and_environment_refer_to_real_code(document: dict[str, Any]) -> None:
    for container in _containers(document):
        command = container["command"]
        if command[:2] == ["python", "-m"]:
            assert importlib.util.find_spec(command[2]) is not None, command
        else:
            assert command[0] == "continuum"
            # Parses as a `continuum` command line (e.g. `migrate compaction` names a migratable service).
            build_parser().parse_args(command[1:])
        for variable in container.get("env", []):
            prefix = next(p for p in SETTINGS if variable["name"].startswith(p))
            field = variable["name"].removeprefix(prefix).lower()
            assert _is_setting(SETTINGS[prefix], field), variable["name"]


def test_services_select_their_deployments() -> None:
    deployments = _named("Deployment")
    for service in _named("Service").values():
        target = deployments[service["metadata"]["name"]]
        assert target["spec"]["template"]["metadata"]["labels"] == service["spec"]["selector"]
        named_ports = {p["name"] for c in _containers(target) for p in c.get("ports", [])}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= named_ports


def test_every_address_names_a_service_port() -> None:
    services = {name: {p["port"] for p in s["spec"]["ports"]} for name, s in _named("Service").items()}
    addresses = {
        variable["name"]: variable["value"]
        for document in _documents()
        for container in _containers(document)
        for variable in container.get("env", [])
        if variable["name"].endswith("_ADDRESS")
    }
    assert {"GATEWAY_TRANSCRIPT_ADDRESS", "GATEWAY_COMPACTION_ADDRESS", "COMPACTION_TRANSCRIPT_ADDRESS"} <= set(
        addresses
    )
    for name, address in addresses.items():
        host, _, port = address.rpartition(":")
        assert int(port) in services.get(host, set()), f"{name}={address} is no Service port"


def test_every_deployment_listens_on_its_container_port_on_every_interface() -> None:
    # The image's ENV: services default to 127.0.0.1, where neither a Service nor a probe reaches them.
    image_env = dict(
        item.split("=", 1)
        for item in shlex.split(re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text()))
        if re.fullmatch(r"[A-Z_]+=.*", item)
    )
    for deployment in _named("Deployment").values():
        for container in _containers(deployment):
            env = {v["name"]: v.get("value") for v in container.get("env", [])}
            prefix = next(p for p in SETTINGS if any(name.startswith(p) for name in env))
            ports = [p["containerPort"] for p in container["ports"]]
            assert [int(env[f"{prefix}PORT"])] == ports, container["name"]
            assert env.get(f"{prefix}HOST", image_env.get(f"{prefix}HOST")) == "0.0.0.0", container["name"]


def test_every_migrating_service_has_a_migration_job_and_does_not_migrate_on_start() -> None:
    jobs = [c["command"] for d in _named("Job").values() for c in _containers(d)]
    image = (DEPLOY / "Dockerfile").read_text()
    for service in ("transcript", "compaction"):
        assert ["continuum", "migrate", service] in jobs
        # The Job migrates; replicas starting together must not race to do it too.
        assert f"{service.upper()}_MIGRATE_ON_START=false" in image


def test_compaction_cleanup_runs_daily_alone() -> None:
    cleanup = _named("CronJob")["compaction-cleanup"]
    [container] = _containers(cleanup)
    assert container["command"] == ["python", "-m", "continuum_compaction", "cleanup"]
    minute, hour, *rest = cleanup["spec"]["schedule"].split()
    assert (minute.isdigit(), hour.isdigit(), rest) == (True, True, ["*", "*", "*"])
    assert cleanup["spec"]["concurrencyPolicy"] == "Forbid"
    env = {v["name"]: v for v in container["env"]}
    # What reconcile needs: the database, and transcript with a token it accepts.
    assert {"COMPACTION_DATABASE_URL", "COMPACTION_SERVICE_TOKEN", "COMPACTION_TRANSCRIPT_ADDRESS"} <= set(env)


def test_compaction_secrets_come_from_secrets() -> None:
    for document in _documents():
        for container in _containers(document):
            for variable in container.get("env", []):
                if variable["name"].endswith(("_DATABASE_URL", "_SERVICE_TOKEN", "_API_KEY")):
                    assert "value" not in variable, variable["name"]
                    assert variable["valueFrom"]["secretKeyRef"]["name"], variable["name"]
    [deployment] = [c for c in _containers(_named("Deployment")["compaction"])]
    token = next(v for v in deployment["env"] if v["name"] == "COMPACTION_SERVICE_TOKEN")
    # The one service token: transcript's, which compaction presents to it.
    assert token["valueFrom"]["secretKeyRef"] == {"name": "transcript", "key": "TRANSCRIPT_SERVICE_TOKEN"}
