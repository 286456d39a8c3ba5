"""The import-linter contracts `make lint` checks cover every package of the project, new services included."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LINTER = PYPROJECT["tool"]["importlinter"]
CONTRACTS: dict[str, dict[str, Any]] = {contract["id"]: contract for contract in LINTER["contracts"]}
# The generated protobuf package: shared by everyone, importing nothing of ours.
GENERATED = "continuum"


def _packages(where: str) -> set[str]:
    return {path.parent.name for path in (ROOT / where).glob("continuum*/__init__.py")}


def test_every_package_of_the_project_is_analysed() -> None:
    packages: set[str] = set()
    for where in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["where"]:
        packages |= _packages(where)

    assert set(LINTER["root_packages"]) == packages - {GENERATED}


def test_every_service_is_independent_and_forbidden_to_gateway_clients_cli_and_runtime() -> None:
    services = set().union(*(_packages(str(path.relative_to(ROOT))) for path in (ROOT / "services").iterdir()))
    assert {"continuum_transcript", "continuum_compaction", "continuum_merge"} <= services

    assert set(CONTRACTS["services-independent"]["modules"]) == services
    assert set(CONTRACTS["services-import-no-front"]["source_modules"]) == services
    assert set(CONTRACTS["fronts-import-no-service"]["forbidden_modules"]) == services
    assert set(CONTRACTS["runtime-imports-nothing-above"]["forbidden_modules"]) >= services


def test_gateway_clients_and_cli_import_no_service_and_runtime_imports_none_of_them() -> None:
    fronts = _packages("gateway") | _packages("clients") | _packages("cli")

    assert set(CONTRACTS["fronts-import-no-service"]["source_modules"]) == fronts
    assert CONTRACTS["runtime-imports-nothing-above"]["source_modules"] == ["continuum_runtime"]
    assert set(CONTRACTS["runtime-imports-nothing-above"]["forbidden_modules"]) >= fronts
