"""The web console's files: served without a token, with exact content types and a strict CSP."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from continuum_gateway import console


async def test_the_page_and_every_file_answer_without_a_token_with_a_strict_policy(
    offline_gateway: httpx.AsyncClient,
) -> None:
    files = console.load_files()
    assert {"index.html", "main.js", "store.js", "style.css"} <= set(files)
    for path in console.open_paths(files):
        response = await offline_gateway.get(path)
        assert response.status_code == 200, path
        name = "index.html" if path == "/" else path.removeprefix(console.FILE_PREFIX)
        assert response.content == files[name].body
        assert response.headers["content-type"] == files[name].content_type
        assert response.headers["content-security-policy"] == console.CONTENT_SECURITY_POLICY
        assert response.headers["x-content-type-options"] == "nosniff"


async def test_a_known_etag_is_answered_304_and_the_api_still_needs_a_token(
    offline_gateway: httpx.AsyncClient,
) -> None:
    first = await offline_gateway.get("/console/main.js")
    again = await offline_gateway.get("/console/main.js", headers={"If-None-Match": first.headers["etag"]})
    assert (again.status_code, again.content) == (304, b"")
    # Only the listed files are open: anything else under /console/ or the API is still 401.
    assert (await offline_gateway.get("/console/secret.js")).status_code == 401
    assert (await offline_gateway.get("/v1/sessions")).status_code == 401


def test_the_scripts_load_nothing_from_another_origin() -> None:
    for name, file in console.load_files().items():
        if name.endswith(".svg"):
            continue  # its xmlns is a name, not a fetch
        text = file.body.decode()
        assert "http://" not in text and "https://" not in text, name
        assert "innerHTML" not in text, name


def test_a_console_past_its_byte_budget_is_refused_at_start(tmp_path: Path) -> None:
    (tmp_path / "index.html").write_bytes(b"x" * (console.MAX_CONSOLE_BYTES + 1))
    with pytest.raises(ValueError, match="exceed"):
        console.load_files(tmp_path)
