"""The Kubernetes manifests, checked offline: well-formed, commands that exist, settings that exist."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic_settings import BaseSettings

from continuum_gateway.settings import GatewaySettings
from continuum_transcript.settings import TranscriptSettings

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
SETTINGS: dict[str, type[BaseSettings]] = {"TRANSCRIPT_": TranscriptSettings, "GATEWAY_": GatewaySettings}


def _documents() -> list[dict[str, Any]]:
    found = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        found += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


def _containers(document: dict[str, Any]) -> list[dict[str, Any]]:
    spec = document["spec"]["template"]["spec"] if "template" in document.get("spec", {}) else {}
    return list(spec.get("containers", []))


def test_every_document_has_the_basic_shape() -> None:
    documents = _documents()
    assert {d["kind"] for d in documents} >= {"Deployment", "Service", "Job"}
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
        for variable in container.get("env", []):
            prefix = next(p for p in SETTINGS if variable["name"].startswith(p))
            field = variable["name"].removeprefix(prefix).lower()
            assert field in SETTINGS[prefix].model_fields, variable["name"]


def test_services_select_their_deployments() -> None:
    documents = _documents()
    deployments = {d["metadata"]["name"]: d for d in documents if d["kind"] == "Deployment"}
    for service in (d for d in documents if d["kind"] == "Service"):
        target = deployments[service["metadata"]["name"]]
        assert target["spec"]["template"]["metadata"]["labels"] == service["spec"]["selector"]
        named_ports = {p["name"] for c in _containers(target) for p in c.get("ports", [])}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= named_ports
