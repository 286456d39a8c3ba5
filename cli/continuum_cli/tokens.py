"""The two credentials of a local run: a per-run service token and a persistent developer token."""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

DEV_TOKEN_FILE = "dev-token"
# token68 (RFC 7235): what fits after "Bearer " in an Authorization header without quoting.
_TOKEN_PATTERN = re.compile(r"^[A-Za-z0-9._~+/-]+=*$")


def new_token() -> str:
    """A fresh 256-bit random token, URL- and header-safe."""
    return secrets.token_urlsafe(32)


def load_or_create_dev_token(data_dir: Path) -> str:
    """The developer token in `<data_dir>/dev-token`, created (mode 0600) when absent or unusable.

    Reused across runs so a browser or script configured with it keeps working after a restart.
    """
    path = data_dir / DEV_TOKEN_FILE
    try:
        existing = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        existing = ""
    if _TOKEN_PATTERN.match(existing):
        # A file copied in or created by hand may be world-readable; the token grants the dev user's access.
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
