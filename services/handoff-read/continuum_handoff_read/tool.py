"""The HandoffRead tool's entry point: one call's arguments over one verified package.

The service has already resolved the run's binding and verified the package's ready.json against the
operation's handoff hash; this module parses the arguments, opens the cursor (before a byte of the
package is read), and runs the action within the call's deadline and output budget. Blocking file
I/O: the service runs it in a worker thread.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from continuum_handoff_read.arguments import Arguments, parse_arguments
from continuum_handoff_read.assets import asset
from continuum_handoff_read.cursors import Cursors, Position
from continuum_handoff_read.deadline import Deadline
from continuum_handoff_read.files import IntactFiles
from continuum_handoff_read.listing import list_directory
from continuum_handoff_read.manifest import Package
from continuum_handoff_read.reading import read
from continuum_handoff_read.results import OUTPUT_BYTES, ToolResult
from continuum_handoff_read.scanners import Scanners
from continuum_handoff_read.search import search

_Action = Callable[[Package, Arguments, Position | None, Cursors], ToolResult]
_ACTIONS: dict[str, _Action] = {"list": list_directory, "search": search, "read": read, "asset": asset}


def execute(
    package_dir: Path,
    package_version: str,
    arguments_json: str,
    *,
    cursor_key: bytes,
    deadline: Deadline,
    intact: IntactFiles | None = None,
    scanners: Scanners | None = None,
) -> ToolResult:
    """Run one HandoffRead call over the package in `package_dir` (``<package root>/<operation id>/``).

    `package_version` is what cursors are bound to (the binding's handoff hash or version: a cursor of
    another package never opens here). `intact` is the service's one IntactFiles (none: every manifest
    is hashed whole on every call). `scanners` are the service's scanner processes a search borrows
    (none: it scans in this thread alone). Raises the service's errors: BadRequest, CursorInvalid,
    RefNotFound, PackageDamaged, AssetTooLarge, BudgetExceeded.
    """
    arguments = parse_arguments(arguments_json)
    cursors = Cursors(cursor_key, package_version)
    start = cursors.open(arguments)
    deadline.check("starting the read")
    with Package(package_dir, deadline, intact, scanners) as package:
        result = _ACTIONS[arguments.action](package, arguments, start, cursors)
    # The pages are built within the budget; this guards the invariant the contract promises.
    if len(result.wrapped().encode()) > OUTPUT_BYTES:
        raise AssertionError("a HandoffRead page exceeded its output budget")
    return result
