"""Generate the Python protobuf package from protos/, or check that the committed copy matches.

Usage: python scripts/protos.py [--check]
"""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ROOT / "protos"
TARGET = ROOT / "protos" / "generated"
# Third-party definitions our contracts import (google.api.field_behavior). Their Python code comes
# from googleapis-common-protos, so they are on the include path but not generated here.
VENDOR = SOURCES / "vendor"
# Our files' descriptors with their comments (protoc's source info), read by the gateway's API reference.
DESCRIPTOR_SET = Path("continuum") / "descriptor_set.binpb"


def generate(out: Path) -> None:
    """Run protoc (from grpcio-tools) over every .proto file into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    proto_files = sorted(str(p.relative_to(SOURCES)) for p in (SOURCES / "continuum").rglob("*.proto"))
    bin_dir = Path(sys.executable).parent
    well_known = str(resources.files("grpc_tools") / "_proto")
    command = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"--plugin=protoc-gen-mypy={bin_dir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bin_dir / 'protoc-gen-mypy_grpc'}",
        f"-I{SOURCES}",
        f"-I{VENDOR}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        f"--descriptor_set_out={out / DESCRIPTOR_SET}",
        "--include_source_info",
        *proto_files,
    ]
    subprocess.run(command, check=True, cwd=SOURCES)
    for directory in [out / "continuum", *(p for p in (out / "continuum").rglob("*") if p.is_dir())]:
        (directory / "__init__.py").touch()
    (out / "continuum" / "py.typed").touch()


def differences(left: Path, right: Path) -> list[str]:
    """Relative paths that differ between two generated trees."""
    found: list[str] = []
    comparison = filecmp.dircmp(left, right, ignore=["__pycache__"])
    stack = [(comparison, Path())]
    while stack:
        node, prefix = stack.pop()
        found += [str(prefix / name) for name in node.left_only + node.right_only + node.diff_files]
        found += [str(prefix / name) for name in node.funny_files]
        stack += [(sub, prefix / name) for name, sub in node.subdirs.items()]
    return sorted(found)


def main() -> int:
    """Entry point."""
    if "--check" in sys.argv[1:]:
        with tempfile.TemporaryDirectory() as scratch:
            fresh = Path(scratch)
            generate(fresh)
            drift = differences(TARGET, fresh)
        if drift:
            print("generated protobuf code is out of date; run `make protos`:", *drift, sep="\n  ")
            return 1
        print("generated protobuf code matches protos/")
        return 0
    shutil.rmtree(TARGET, ignore_errors=True)
    generate(TARGET)
    return 0


if __name__ == "__main__":
    sys.exit(main())
