"""The API reference page: the OpenAPI document rendered as one self-contained HTML page.

    GET /v1/reference    text/html (no token needed)

Rendered on the server with no script, font or stylesheet from anywhere else, so it works where the
gateway has no internet and needs nothing but a browser. Each operation shows its parameters, body
and responses; each schema its fields with type, whether required, and the contract's comment.
The worked examples are in the repository's ``docs/api.md``.
"""

from __future__ import annotations

import html
import json
import re
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from continuum_gateway.openapi import OPENAPI_PATH, ApiDocument
from continuum_gateway.routing import Operation, Resource

REFERENCE_PATH = "/v1/reference"
_METHODS = ("get", "post", "put", "patch", "delete")
_CODE = re.compile(r"`([^`]+)`")
_BOLD = re.compile(r"\*\*([^*]+)\*\*")
_STYLE = """
body{font:15px/1.5 system-ui,sans-serif;margin:0 auto;max-width:70rem;padding:1rem 2rem;color:#1d1d1f}
code,pre{font-family:ui-monospace,monospace;font-size:13px;background:#f3f3f5;padding:0 .2em}
table{border-collapse:collapse;width:100%;margin:.5rem 0}
td,th{border:1px solid #ddd;padding:.3rem .5rem;text-align:left;vertical-align:top}
th{background:#f7f7f9}.method{font-weight:700;text-transform:uppercase;margin-right:.5rem}
section{border-top:1px solid #ddd;padding-top:.5rem;margin-top:1.5rem}nav li{margin:.1rem 0}
"""


def routes(document: ApiDocument) -> list[Resource]:
    """The route serving the page of `document`."""
    rendered: list[str] = []

    async def api_reference(request: Request) -> Response:
        """This reference, as HTML."""
        if not rendered:
            rendered.append(render(document.get()))
        return HTMLResponse(rendered[0])

    operation = Operation(
        api_reference, response=lambda schemas: {"type": "string"}, media_type="text/html", public=True
    )
    return [Resource(REFERENCE_PATH, "reference", {"GET": operation})]


def render(document: dict[str, Any]) -> str:
    """The page of an OpenAPI document."""
    info = document["info"]
    nav, sections = [], []
    for path, item in document["paths"].items():
        for method in _METHODS:
            if method in item:
                operation = item[method]
                anchor = operation["operationId"]
                nav.append(f'<li><a href="#{anchor}"><span class="method">{method}</span>{_text(path)}</a></li>')
                sections.append(_operation(method, path, operation))
        if "x-websocket" in item:
            nav.append(f'<li><a href="#follow"><span class="method">ws</span>{_text(path)}</a></li>')
            sections.append(_websocket(path, item))
    schemas = document["components"]["schemas"]
    schema_sections = [_schema(name, schema) for name, schema in schemas.items()]
    return "".join(
        [
            "<!doctype html><html lang=en><head><meta charset=utf-8>",
            f"<title>{_text(info['title'])} API reference</title><style>{_STYLE}</style></head><body>",
            f"<h1>{_text(info['title'])} API {_text(info['version'])}</h1>",
            _prose(info.get("description", "")),
            f'<p>The same, machine-readable: <a href="{OPENAPI_PATH}">{OPENAPI_PATH}</a> (OpenAPI 3.1).</p>',
            "<h2>Routes</h2><nav><ul>",
            *nav,
            "</ul></nav>",
            *sections,
            "<h2>Schemas</h2>",
            *schema_sections,
            "</body></html>",
        ]
    )


def _operation(method: str, path: str, operation: dict[str, Any]) -> str:
    parts = [
        f'<section id="{_text(operation["operationId"])}"><h3><span class="method">{method}</span>'
        f"<code>{_text(path)}</code></h3>",
        _prose(operation.get("summary", "")),
        _prose(operation.get("description", "")),
    ]
    if operation.get("security") == []:
        parts.append("<p>No token needed.</p>")
    parameters = operation.get("parameters", [])
    if parameters:
        rows = [
            [
                f"<code>{_text(p['name'])}</code>",
                _text(p["in"]),
                _type(p["schema"]),
                "yes" if p.get("required") else "",
                _prose(p.get("description", p["schema"].get("description", ""))),
            ]
            for p in parameters
        ]
        parts.append("<h4>Parameters</h4>" + _table(["name", "in", "type", "required", "description"], rows))
    body = operation.get("requestBody")
    if body:
        schema = body["content"]["application/json"]["schema"]
        required = " (required)" if body.get("required") else " (optional)"
        parts.append(f"<h4>Body{required}</h4><p>JSON: {_type(schema)}</p>")
    rows = []
    for status, response in operation["responses"].items():
        content = response.get("content", {})
        shown = next(iter(content.values()))["schema"] if content else None
        headers = ", ".join(f"<code>{_text(h)}</code>" for h in response.get("headers", {}))
        rows.append(
            [
                _text(status),
                _prose(response["description"]) + (f"<p>Headers: {headers}</p>" if headers else ""),
                _type(shown) if shown is not None else "",
            ]
        )
    parts.append("<h4>Responses</h4>" + _table(["status", "meaning", "body"], rows))
    parts.append("</section>")
    return "".join(parts)


def _websocket(path: str, item: dict[str, Any]) -> str:
    socket = item["x-websocket"]
    subprotocols = ", ".join(f"<code>{_text(p)}</code>" for p in socket["subprotocols"])
    server = " or ".join(_type(message) for message in socket["server-messages"])
    return (
        f'<section id="follow"><h3><span class="method">ws</span><code>{_text(path)}</code></h3>'
        f"{_prose(item['summary'])}{_prose(item['description'])}"
        f"<p>Subprotocols: {subprotocols}</p><p>Client sends: {_type(socket['client-messages'])}</p>"
        f"<p>Server sends: {server}</p><p>Close codes: {_text(socket['close-codes'])}</p></section>"
    )


def _schema(name: str, schema: dict[str, Any]) -> str:
    parts = [f'<section id="schema-{_text(name)}"><h3><code>{_text(name)}</code></h3>']
    parts.append(_prose(schema.get("description", "")))
    properties = schema.get("properties")
    if properties:
        required = set(schema.get("required", []))
        rows = [
            [
                f"<code>{_text(field)}</code>",
                _type(value),
                "yes" if field in required else "",
                _prose(value.get("description", ""))
                + ("<p>Output only: ignored in requests.</p>" if value.get("readOnly") else ""),
            ]
            for field, value in properties.items()
        ]
        parts.append(_table(["field", "type", "required", "description"], rows))
        if "not" in schema:
            pairs = [" and ".join(pair["required"]) for pair in schema["not"]["anyOf"]]
            parts.append(f"<p>Never both: {_text('; '.join(pairs))}.</p>")
    elif "enum" not in schema:
        parts.append(f"<p>{_type(schema)}</p>")
    parts.append("</section>")
    return "".join(parts)


def _type(schema: dict[str, Any]) -> str:
    """A schema in a few words, with links to the schemas it names."""
    if "$ref" in schema:
        name = str(schema["$ref"]).rsplit("/", 1)[-1]
        return f'<a href="#schema-{_text(name)}">{_text(name)}</a>'
    if "const" in schema:
        return f"<code>{_text(json.dumps(schema['const']))}</code>"
    if "enum" in schema:
        return "one of " + ", ".join(f"<code>{_text(str(v))}</code>" for v in schema["enum"])
    if "anyOf" in schema:
        return " or ".join(_type(option) for option in schema["anyOf"])
    kind = schema.get("type")
    if kind == "array":
        return "array of " + _type(schema.get("items", {}))
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return "object of " + _type(schema["additionalProperties"])
    if kind is None:
        return "any JSON value"
    text = " or ".join(kind) if isinstance(kind, list) else str(kind)
    if "format" in schema:
        text += f" ({schema['format']})"
    return _text(text)


def _table(headings: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{_text(h)}</th>" for h in headings)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _prose(text: str) -> str:
    """Comment text as HTML: paragraphs, ``- `` lists, `code` and **bold**; everything escaped."""
    blocks = []
    for block in re.split(r"\n\s*\n", text.strip()):
        if not block:
            continue
        lines = block.splitlines()
        if all(line.startswith("- ") for line in lines):
            items = "".join(f"<li>{_inline(line[2:])}</li>" for line in lines)
            blocks.append(f"<ul>{items}</ul>")
        else:
            blocks.append(f"<p>{_inline(' '.join(line.strip() for line in lines))}</p>")
    return "".join(blocks)


def _inline(text: str) -> str:
    escaped = _text(text)
    return _BOLD.sub(r"<strong>\1</strong>", _CODE.sub(r"<code>\1</code>", escaped))


def _text(text: str) -> str:
    return html.escape(text, quote=True)
