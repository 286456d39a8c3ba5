"""The name a replica's claims carry: stable across its restarts, never shared by two live replicas."""

from __future__ import annotations

import socket

import pytest
from pydantic import ValidationError

from continuum_compaction.claim_holder import instance_name
from continuum_compaction.settings import CompactionSettings


def test_a_configured_instance_id_names_the_replica() -> None:
    assert instance_name(CompactionSettings(instance_id="replica-a", port=50152)) == ("replica-a", True)


def test_by_default_a_replica_is_its_host_and_bound_address() -> None:
    # The same on every start of the process that binds this address; no other live process binds it.
    named = instance_name(CompactionSettings(host="0.0.0.0", port=50152))

    assert named == (f"{socket.gethostname()}@0.0.0.0:50152", True)


def test_on_port_0_every_start_has_a_name_of_its_own() -> None:
    first, second = instance_name(CompactionSettings(port=0)), instance_name(CompactionSettings(port=0))

    assert first[0] != second[0]
    # Nothing a previous start held can be recognised, so nothing is released at start.
    assert (first[1], second[1]) == (False, False)


@pytest.mark.parametrize(
    "values",
    [
        {"claim_ttl_seconds": 15, "claim_renew_seconds": 15},
        {"claim_ttl_seconds": 1},
        {"instance_id": "replica a"},
        {"instance_id": "r" * 201},
    ],
)
def test_claim_settings_are_checked(values: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        CompactionSettings(**values)  # type: ignore[arg-type]
