"""The web console: static ES modules and CSS served at ``/`` and ``/console/<file>``, no token needed.

    GET /                     the console's page (index.html)
    GET /console/<file>       its scripts, style sheet and icon

The files are the package's ``console/`` directory, read once when the app is built (they are part of
the release, a few dozen KiB, refused at start beyond `MAX_CONSOLE_BYTES`), so a request never touches
the disk. Nothing is fetched from another origin: every answer carries a strict Content-Security-Policy
(scripts, styles and connections from this origin only, no inline script, no framing), and
``nosniff`` with the exact content type. The page itself holds no data: the browser signs in with a
bearer token and calls the API like any other client, so serving it without a token reveals nothing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

CONSOLE_DIRECTORY = Path(__file__).parent / "console"
ENTRY_FILE = "index.html"
FILE_PREFIX = "/console/"
# The console is a handful of small files; anything near this is a packaging mistake, not a console.
MAX_CONSOLE_BYTES = 2 * 1024 * 1024

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}

# 'self' covers the Follow WebSocket of the same host and port in current browsers.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # Revalidate every time (cheap with the ETag): a new release's files are never mixed with old ones.
    "Cache-Control": "no-cache",
}


@dataclass(frozen=True)
class ConsoleFile:
    """One file of the console, as served."""

    body: bytes
    content_type: str
    etag: str


def load_files(directory: Path = CONSOLE_DIRECTORY) -> dict[str, ConsoleFile]:
    """Every servable file of `directory` by name; ValueError past `MAX_CONSOLE_BYTES` in total."""
    files: dict[str, ConsoleFile] = {}
    total = 0
    for path in sorted(directory.iterdir()):
        content_type = CONTENT_TYPES.get(path.suffix)
        if content_type is None or not path.is_file():
            continue
        total += path.stat().st_size
        if total > MAX_CONSOLE_BYTES:
            raise ValueError(f"the console's files exceed {MAX_CONSOLE_BYTES} bytes")
        body = path.read_bytes()
        files[path.name] = ConsoleFile(body, content_type, '"' + hashlib.sha256(body).hexdigest()[:32] + '"')
    if ENTRY_FILE not in files:
        raise ValueError(f"the console has no {ENTRY_FILE}")
    return files


def _answer(request: Request, file: ConsoleFile) -> Response:
    headers = {**SECURITY_HEADERS, "ETag": file.etag}
    if request.headers.get("if-none-match") == file.etag:
        return Response(status_code=304, headers=headers)
    return Response(file.body, media_type=file.content_type, headers=headers)


def routes(files: dict[str, ConsoleFile]) -> list[BaseRoute]:
    """``/`` and one route per file; they are plain routes, not API resources (no OpenAPI entry)."""

    async def console_page(request: Request) -> Response:
        """The console's page."""
        return _answer(request, files[ENTRY_FILE])

    def serve(name: str, file: ConsoleFile) -> Route:
        async def console_file(request: Request) -> Response:
            """One of the console's files."""
            return _answer(request, file)

        return Route(FILE_PREFIX + name, console_file, methods=["GET", "HEAD"])

    served: list[BaseRoute] = [Route("/", console_page, methods=["GET", "HEAD"])]
    for name, file in files.items():
        served.append(serve(name, file))
    return served


def open_paths(files: dict[str, ConsoleFile]) -> list[str]:
    """The paths that answer without a token: the page and its files."""
    return ["/", *(FILE_PREFIX + name for name in files)]
