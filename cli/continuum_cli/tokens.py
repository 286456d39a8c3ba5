"""The secrets of a local run, kept as private files in its data dir.

The service token is fresh every run; the developer token and the page-token secret are reused
across runs. Other commands (`continuum follow`, `continuum cleanup`) read them from the same files.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

DEV_TOKEN_FILE = "dev-token"
SERVICE_TOKEN_FILE = "service-token"
PAGE_TOKEN_SECRET_FILE = "page-token-secret"
# token68 (RFC 7235): what fits after "Bearer " in an Authorization header without quoting.
_TOKEN_PATTERN = re.compile(r"^[A-Za-z0-9._~+/-]+=*$")


def new_token() -> str:
    """A fresh 256-bit random token, URL- and header-safe."""
    return secrets.token_urlsafe(32)


def load_or_create_dev_token(data_dir: Path) -> str:
    """The developer token in `<data_dir>/dev-token`, created (mode 0600) when absent or unusable.

    Reused across runs so a browser or script configured with it keeps working after a restart.
    """
    return _load_or_create(data_dir / DEV_TOKEN_FILE)


def load_or_create_page_token_secret(data_dir: Path) -> str:
    """The key the services sign page tokens with, in `<data_dir>/page-token-secret` (mode 0600).

    Reused across runs so a page token a client holds still reads on after a restart.
    """
    return _load_or_create(data_dir / PAGE_TOKEN_SECRET_FILE)


def write_service_token(data_dir: Path, token: str) -> Path:
    """Keep this run's service token in `<data_dir>/service-token` (mode 0600); returns that path."""
    path = data_dir / SERVICE_TOKEN_FILE
    _write_private(path, token)
    return path


def read_token(path: Path) -> str | None:
    """The token kept in `path`, or None when the file is absent or holds no usable token."""
    try:
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    return text if _TOKEN_PATTERN.match(text) else None


def _load_or_create(path: Path) -> str:
    existing = read_token(path)
    if existing is not None:
        # A file copied in or created by hand may be world-readable; the token grants access.
        os.chmod(path, 0o600)
        return existing
    token = new_token()
    _write_private(path, token)
    return token


def _write_private(path: Path, content: str) -> None:
    # Created 0600 from the first byte (no window where another user could read it), then renamed into place.
    scratch = path.with_name(f".{path.name}.tmp")
    scratch.unlink(missing_ok=True)
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(content + "\n")
    scratch.replace(path)
