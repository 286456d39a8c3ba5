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

from continuum_agent.settings import AgentSettings
from continuum_cli.main import build_parser
from continuum_compaction.settings import CompactionSettings
from continuum_gateway.settings import GatewaySettings
from continuum_handoff_read.settings import HandoffReadSettings
from continuum_merge.settings import MergeSettings
from continuum_transcript.settings import TranscriptSettings

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
K8S = DEPLOY / "k8s"
SETTINGS: dict[str, type[BaseSettings]] = {
    "TRANSCRIPT_": TranscriptSettings,
    "COMPACTION_": CompactionSettings,
    "MERGE_": MergeSettings,
    "HANDOFF_READ_": HandoffReadSettings,
    "AGENT_": AgentSettings,
    "GATEWAY_": GatewaySettings,
}
# The gRPC services: each signs its page tokens with `<PREFIX>PAGE_TOKEN_SECRET`.
SERVICES = {"transcript": "TRANSCRIPT_", "compaction": "COMPACTION_", "merge": "MERGE_"}
# How a manifest documents the keys of a Secret a container reads whole (envFrom).
SECRET_KEYS = re.compile(r"^# Secret (\S+) keys: (.+)$", re.MULTILINE)


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


def _documented_secret_keys() -> dict[str, set[str]]:
    """Secret name -> the keys the manifests' comments say it holds."""
    found: dict[str, set[str]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for name, keys in SECRET_KEYS.findall(path.read_text()):
            found.setdefault(name, set()).update(key.strip() for key in keys.split(","))
    return found


def _secret_variables(container: dict[str, Any]) -> set[str]:
    """The variables a container takes from Secrets: named one by one, or every documented key of a whole Secret."""
    documented = _documented_secret_keys()
    names = {v["name"] for v in container.get("env", []) if "secretKeyRef" in v.get("valueFrom", {})}
    for source in container.get("envFrom", []):
        names |= documented[source["secretRef"]["name"]]
    return names


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
        for name in {variable["name"] for variable in container.get("env", [])} | _secret_variables(container):
            prefix = next(p for p in SETTINGS if name.startswith(p))
            field = name.removeprefix(prefix).lower()
            assert _is_setting(SETTINGS[prefix], field), name


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
    assert {
        "GATEWAY_TRANSCRIPT_ADDRESS",
        "GATEWAY_COMPACTION_ADDRESS",
        "GATEWAY_MERGE_ADDRESS",
        "GATEWAY_AGENT_ADDRESS",
        "AGENT_TRANSCRIPT_ADDRESS",
        "AGENT_COMPACTION_ADDRESS",
        "AGENT_HANDOFF_READ_ADDRESS",
        "COMPACTION_TRANSCRIPT_ADDRESS",
        "MERGE_TRANSCRIPT_ADDRESS",
        "HANDOFF_READ_TRANSCRIPT_ADDRESS",
        "HANDOFF_READ_MERGE_ADDRESS",
        "COMPACTION_HANDOFF_READ_ADDRESS",
    } <= set(addresses)
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
    for service in ("transcript", "compaction", "merge"):
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


def test_service_secrets_come_from_secrets() -> None:
    for document in _documents():
        for container in _containers(document):
            for variable in container.get("env", []):
                if variable["name"].endswith(("_DATABASE_URL", "_SERVICE_TOKEN", "_API_KEY", "_PAGE_TOKEN_SECRET")):
                    assert "value" not in variable, variable["name"]
                    assert variable["valueFrom"]["secretKeyRef"]["name"], variable["name"]
    for name, prefix in (
        ("compaction", "COMPACTION_"),
        ("merge", "MERGE_"),
        ("handoff-read", "HANDOFF_READ_"),
        ("agent", "AGENT_"),
    ):
        [deployment] = _containers(_named("Deployment")[name])
        token = next(v for v in deployment["env"] if v["name"] == f"{prefix}SERVICE_TOKEN")
        # The one service token: transcript's, which the service presents to it.
        assert token["valueFrom"]["secretKeyRef"] == {"name": "transcript", "key": "TRANSCRIPT_SERVICE_TOKEN"}


def test_every_secret_read_whole_has_its_keys_documented() -> None:
    documented = _documented_secret_keys()
    for document in _documents():
        for container in _containers(document):
            for source in container.get("envFrom", []):
                assert source["secretRef"]["name"] in documented, source


def test_every_service_replica_signs_page_tokens_with_a_secret_of_its_deployment() -> None:
    deployments = _named("Deployment")
    for name, prefix in SERVICES.items():
        [container] = _containers(deployments[name])
        assert f"{prefix}PAGE_TOKEN_SECRET" in _secret_variables(container), name
    # The gateway passes the services' page tokens through and signs none.
    [gateway] = _containers(deployments["gateway"])
    assert not [name for name in _secret_variables(gateway) if name.endswith("PAGE_TOKEN_SECRET")]


def test_transcript_runs_one_replica_and_never_two_during_a_rollout() -> None:
    # Its Follow publishers live in one process's memory; two replicas would fence each other's.
    transcript = _named("Deployment")["transcript"]["spec"]

    assert transcript["replicas"] == 1
    assert transcript["strategy"] == {"type": "Recreate"}


def test_every_merge_replica_leases_operations_under_its_pod_name() -> None:
    merge = _named("Deployment")["merge"]
    [container] = _containers(merge)
    # Replicas take each other's operations over, each naming its leases by its pod.
    assert merge["spec"]["replicas"] > 1
    instance = next(v for v in container["env"] if v["name"] == "MERGE_INSTANCE_ID")
    assert instance["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_merge_replicas_and_its_cleanup_share_one_package_volume() -> None:
    claims = _named("PersistentVolumeClaim")
    assert claims["merge-packages"]["spec"]["accessModes"] == ["ReadWriteMany"]
    for document in (_named("Deployment")["merge"], _named("CronJob")["merge-cleanup"]):
        volumes = {v["name"]: v for v in _pod_spec(document)["volumes"]}
        assert volumes["packages"]["persistentVolumeClaim"] == {"claimName": "merge-packages"}
        [container] = _containers(document)
        env = {v["name"]: v.get("value") for v in container["env"]}
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert env["MERGE_PACKAGE_ROOT"].startswith(mounts["packages"] + "/")
    [cleanup] = _containers(_named("CronJob")["merge-cleanup"])
    assert cleanup["command"] == ["python", "-m", "continuum_merge", "cleanup"]


def test_handoff_read_mounts_merges_packages_read_only_where_merge_writes_them() -> None:
    handoff_read = _named("Deployment")["handoff-read"]
    [container] = _containers(handoff_read)
    [merge] = _containers(_named("Deployment")["merge"])
    env = {v["name"]: v.get("value") for v in container["env"]}
    merge_env = {v["name"]: v.get("value") for v in merge["env"]}
    volumes = {v["name"]: v for v in _pod_spec(handoff_read)["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}

    assert env["HANDOFF_READ_PACKAGE_ROOT"] == merge_env["MERGE_PACKAGE_ROOT"]
    assert volumes["packages"]["persistentVolumeClaim"] == {"claimName": "merge-packages", "readOnly": True}
    assert mounts["packages"]["readOnly"] is True
    assert env["HANDOFF_READ_PACKAGE_ROOT"].startswith(mounts["packages"]["mountPath"] + "/")
    # Every replica authenticates cursors with the one key of its Secret, read from a file.
    assert volumes["cursor-secret"]["secret"]["secretName"] == "handoff-read"
    [item] = volumes["cursor-secret"]["secret"]["items"]
    assert env["HANDOFF_READ_CURSOR_SECRET_FILE"] == f"{mounts['cursor-secret']['mountPath']}/{item['path']}"
    assert item["key"] in _documented_secret_keys()["handoff-read"]
    # No database: nothing to migrate, no URL.
    assert not [name for name in env if name.endswith("_DATABASE_URL")]


def test_the_agent_is_configured_by_its_manifest_and_stops_its_turns_inside_the_grace_period() -> None:
    agent = _named("Deployment")["agent"]
    [container] = _containers(agent)
    plain = {v["name"]: v["value"] for v in container["env"] if "value" in v}
    # The manifest's values are settings the agent accepts as they stand (renewal inside the lease, ...).
    settings = AgentSettings(
        **{name.removeprefix("AGENT_").lower(): value for name, value in plain.items() if "__" not in name}
    )
    assert settings.port == 50154
    # Replicas reach each other's turns through transcript (replays, stops fencing the RUN claim).
    assert agent["spec"]["replicas"] > 1
    assert settings.claim_renew_seconds < settings.claim_ttl_seconds
    # Running turns stop (interrupted answers stored, claims released) before the pod is killed.
    assert settings.shutdown_grace_seconds < agent["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    # No database: nothing to migrate, no URL; the provider key comes from the agent's Secret.
    assert not [name for name in plain if name.endswith("_DATABASE_URL")]
    key = next(v for v in container["env"] if v["name"] == "AGENT_PROVIDER__API_KEY")
    assert key["valueFrom"]["secretKeyRef"] == {"name": "agent", "key": "AGENT_PROVIDER__API_KEY"}
    assert "AGENT_PROVIDER__API_KEY" in _documented_secret_keys()["agent"]
    # The data dir holds run files only.
    volumes = {v["name"]: v for v in _pod_spec(agent)["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert "emptyDir" in volumes["data"] and mounts["data"] == plain["AGENT_DATA_DIR"]
