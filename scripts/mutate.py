"""Mutation testing of the invariant modules with mutmut; prints the mutants no test killed.

    .venv/bin/python scripts/mutate.py [GROUP ...]      # `make mutate [GROUPS="compaction gateway"]`

Not part of CI: a run takes minutes to hours. Each group mutates some modules of one package and
runs only the tests that exercise them (SQLite variants plus the PostgreSQL-only race tests).

mutmut 3 names a mutant by its file's path under `src/` (or the root) and runs the tests in a copy
of the tree (`mutants/`) with that copy first on sys.path, while this repository keeps its packages
under runtime/, services/*/, gateway/ and clients/. So each group gets a staging directory
`.mutate/<group>/` laid out as mutmut expects: `src/<package>` (a copy of the package to mutate), the
service's migrations beside it at `src/migrations` (servers find them next to their package), the
test directories and conftest.py, and this pyproject.toml with a `[tool.mutmut]` section. Packages
not being mutated are imported from the editable install as usual.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGING = ROOT / ".mutate"
MUTMUT = Path(sys.executable).parent / "mutmut"
TEST_DIRS = (
    "runtime/tests",
    "services/transcript/tests",
    "services/compaction/tests",
    "clients/tests",
    "gateway/tests",
    "cli/tests",
    "tests",
)


@dataclass(frozen=True)
class Group:
    """Modules of one package to mutate and the tests that must kill their mutants."""

    package: str
    modules: tuple[str, ...]
    tests: tuple[str, ...]
    migrations: str | None = None


GROUPS = {
    # Compare-and-set of the summary record, whole-turn cuts.
    "compaction": Group(
        package="services/compaction/continuum_compaction",
        migrations="services/compaction/migrations",
        modules=("store.py", "cuts.py"),
        tests=(
            "services/compaction/tests/test_cuts_and_facts_units.py",
            "services/compaction/tests/test_races.py",
            "services/compaction/tests/test_build_context.py",
            "services/compaction/tests/test_boundary_repair.py",
            "services/compaction/tests/test_manual.py",
            "services/compaction/tests/test_cleanup_and_facts.py",
        ),
    ),
    # The compaction fence, execution claims, the edit guard, the live publisher.
    "transcript": Group(
        package="services/transcript/continuum_transcript",
        migrations="services/transcript/migrations",
        modules=("fence.py", "claims.py", "messages.py", "publisher.py"),
        tests=(
            "services/transcript/tests/test_compaction_fence.py",
            "services/transcript/tests/test_claims.py",
            "services/transcript/tests/test_messages.py",
            "services/transcript/tests/test_follow.py",
            "services/transcript/tests/test_attempt_races.py",
        ),
    ),
    # Authenticated page tokens, service credentials and the acting user.
    "runtime": Group(
        package="runtime/continuum_runtime",
        modules=("paging.py", "auth.py"),
        tests=(
            "services/transcript/tests/test_sessions.py",
            "services/transcript/tests/test_messages.py",
            "gateway/tests/test_page_tokens.py",
        ),
    ),
    # Browser authentication.
    "gateway": Group(
        package="gateway/continuum_gateway",
        modules=("auth.py",),
        tests=("gateway/tests/test_auth.py", "gateway/tests/test_routes.py", "gateway/tests/test_follow.py"),
    ),
}


def _toml_list(values: list[str]) -> str:
    return json.dumps(values)


def stage(name: str, group: Group) -> Path:
    """A fresh staging directory for `group` (see the module docstring)."""
    staging = STAGING / name
    if staging.exists():
        shutil.rmtree(staging)
    package = Path(group.package)
    source = staging / "src" / package.name
    shutil.copytree(ROOT / package, source, ignore=shutil.ignore_patterns("__pycache__"))
    if group.migrations is not None:
        shutil.copytree(ROOT / group.migrations, staging / "src" / "migrations")
    for tests in TEST_DIRS:
        (staging / tests).parent.mkdir(parents=True, exist_ok=True)
        (staging / tests).symlink_to(ROOT / tests, target_is_directory=True)
    (staging / "conftest.py").symlink_to(ROOT / "conftest.py")
    settings = {
        "source_paths": ["src"],
        "only_mutate": [f"src/{package.name}/{module}" for module in group.modules],
        "also_copy": [*TEST_DIRS, "conftest.py"],
        "pytest_add_cli_args_test_selection": list(group.tests),
        # SQLite variants only, except tests that exist for PostgreSQL alone (its races).
        "pytest_add_cli_args": ["-p", "no:cacheprovider", "-m", "not postgres"],
    }
    lines = ["", "[tool.mutmut]"]
    lines += [f"{key} = {_toml_list(value)}" for key, value in settings.items()]
    # gRPC is not fork-safe: workers fork from a server process that never opened a channel.
    lines.append('process_isolation = "forkserver"')
    pyproject = (ROOT / "pyproject.toml").read_text() + "\n".join(lines) + "\n"
    (staging / "pyproject.toml").write_text(pyproject)
    return staging


# mutmut's verdicts that mean no selected test failed on the mutant.
SURVIVED = ("survived", "no tests")


def survivors(staging: Path) -> list[str]:
    """`name: verdict` of the mutants no selected test killed (or that no selected test reached)."""
    listed = subprocess.run(
        [str(MUTMUT), "results"], cwd=staging, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    return [line.strip() for line in listed if line.strip().endswith(SURVIVED)]


def mutate(name: str, group: Group, max_children: int) -> list[str]:
    """Run mutmut for one group; its survivors, each with its diff printed."""
    staging = stage(name, group)
    print(f"== {name}: mutating {', '.join(group.modules)} of {group.package}", flush=True)
    run = subprocess.run([str(MUTMUT), "run", "--max-children", str(max_children)], cwd=staging, check=False)
    if run.returncode != 0:
        raise SystemExit(f"mutmut failed for {name} (exit {run.returncode})")
    found = survivors(staging)
    for mutant in found:
        shown = subprocess.run(
            [str(MUTMUT), "show", mutant.split(":")[0]], cwd=staging, capture_output=True, text=True, check=False
        )
        print(f"-- {mutant}\n{shown.stdout}", flush=True)
    print(f"== {name}: {len(found)} survivor(s)", flush=True)
    return found


def main() -> None:
    """Mutate the chosen groups (all by default) and list every survivor at the end."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("groups", nargs="*", choices=list(GROUPS), help="default: all")
    parser.add_argument("--max-children", type=int, default=2, help="mutants tested at once")
    args = parser.parse_args()
    every: list[str] = []
    for name in args.groups or list(GROUPS):
        every += mutate(name, GROUPS[name], args.max_children)
    print("\nSurviving mutants:" if every else "\nNo surviving mutants.")
    for mutant in every:
        print(f"  {mutant}")


if __name__ == "__main__":
    main()
