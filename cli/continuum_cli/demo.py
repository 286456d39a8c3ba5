"""The demo workspace `continuum up` seeds into an empty data dir, through the gateway like any client.

Two sessions of one task, renaming a user record's field `name` to `displayName`: the backend half, a
long history (40 turns, each with a tool round) that is compacted once, and the web-client half, whose
tool result was cut short (the truncation badge). Both work in `<data dir>/demo-project/`, a small
project the agent's read-only tools can list, read and search when a person sends a message; its
`MEMORY.md` gives the agent three memory entries for every request.

Seeding is idempotent: the sessions have fixed ids (creating one again answers the existing one), a
session's history is appended only while it is empty, and the compaction runs only while the session has
no summary. A `demo-seed.pending` marker is written as soon as a run finds the data dir empty, before it
creates anything there, and removed after the seed's last step: a run refused at start (a port in use)
or interrupted halfway leaves files behind, and the next run still seeds.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx

PENDING_MARKER = "demo-seed.pending"
PROJECT_DIRECTORY = "demo-project"
BACKEND_SESSION = "demo-rename-backend"
CLIENT_SESSION = "demo-rename-web"
BACKEND_TURNS = 40
CLIENT_TURNS = 8
# Small enough that the forced compaction has whole turns to summarize and keeps a recent tail.
COMPACTION_WINDOW_TOKENS = 4096
REQUEST_TIMEOUT_SECONDS = 60.0

PROJECT_FILES: Mapping[str, str] = {
    "README.md": "# Profiles\n\nA user profile has a `name` shown on the profile page and in mentions.\n",
    # The reference agent's memory file: one entry per bullet, sent with every model request of a turn
    # (the Context tab's memory chips) unless the session's memory switch is off.
    "MEMORY.md": (
        "# Memory\n\n"
        "- The profile field `name` is being renamed to `displayName`; keep the JSON key `name` readable\n"
        "  for one release.\n"
        "- Database migrations live in server/migrations and are numbered with four digits.\n"
        "- The web client formats mentions as @displayName.\n"
    ),
    "server/profile.py": (
        "from dataclasses import dataclass\n\n\n@dataclass\nclass Profile:\n    user_id: str\n    name: str\n\n\n"
        "def to_json(profile: Profile) -> dict[str, str]:\n"
        '    return {"userId": profile.user_id, "name": profile.name}\n'
    ),
    "server/routes.py": (
        "from server.profile import Profile, to_json\n\n\ndef rename(profile: Profile, name: str) -> dict[str, str]:\n"
        "    profile.name = name\n    return to_json(profile)\n"
    ),
    "server/migrations/0007_display_name.sql": "ALTER TABLE profile RENAME COLUMN name TO display_name;\n",
    "web/profile.js": (
        "export function profileCard(profile) {\n  return `<h2>${profile.name}</h2>`;\n}\n\n"
        "export function mention(profile) {\n  return `@${profile.name}`;\n}\n"
    ),
    "web/settings.js": (
        "export const fields = [\n  { key: 'name', label: 'Name' },\n  { key: 'email', label: 'Email' },\n];\n"
    ),
}

_BACKEND_STEPS = [
    ("Where is the profile's `name` field defined?", "search_text", {"query": "name"}),
    ("Show me server/profile.py.", "read_file", {"path": "server/profile.py"}),
    ("Which routes write the name?", "read_file", {"path": "server/routes.py"}),
    ("Is there a migration for the column yet?", "list_directory", {"path": "server/migrations"}),
    ("What does the JSON of a profile look like?", "search_text", {"query": "to_json"}),
]
_CLIENT_STEPS = [
    ("Which web files read profile.name?", "search_text", {"query": "profile.name"}),
    ("Show me web/profile.js.", "read_file", {"path": "web/profile.js"}),
    ("And the settings form?", "read_file", {"path": "web/settings.js"}),
]


def is_empty(data_dir: Path) -> bool:
    """True when `data_dir` does not exist or holds nothing: the only data dir a demo is seeded into."""
    return not data_dir.exists() or not any(data_dir.iterdir())


def promise(data_dir: Path) -> None:
    """Mark `data_dir` (found empty, now created) as owed the demo until a seed finishes."""
    (data_dir / PENDING_MARKER).touch()


def wanted(data_dir: Path, was_empty: bool) -> bool:
    """Whether this run seeds: the data dir was empty at start, or an earlier seed did not finish."""
    return was_empty or (data_dir / PENDING_MARKER).exists()


def _turns(steps: list[tuple[str, str, dict[str, str]]], count: int, label: str) -> Iterator[list[dict[str, Any]]]:
    """`count` turns cycling through `steps`: a question, a tool call, its result and an answer."""
    for turn in range(1, count + 1):
        question, tool, arguments = steps[(turn - 1) % len(steps)]
        call_id = f"{label}-{turn}"
        result = _tool_result(tool, arguments)
        yield [
            {"role": "MESSAGE_ROLE_USER", "content": [{"text": f"Step {turn}: {question}"}]},
            {
                "role": "MESSAGE_ROLE_ASSISTANT",
                "content": [{"text": f"Let me check with {tool}."}],
                "toolCalls": [{"toolCallId": call_id, "name": tool, "arguments": json.dumps(arguments)}],
            },
            {"role": "MESSAGE_ROLE_TOOL", "toolCallId": call_id, "content": [{"text": json.dumps(result)}]},
            {
                "role": "MESSAGE_ROLE_ASSISTANT",
                "content": [
                    {
                        "text": f"Step {turn} done: `name` becomes `displayName` in what {tool} showed; "
                        "the JSON key, the dataclass field and the column move together so old clients "
                        "get a clear error instead of a silent blank."
                    }
                ],
            },
        ]


def _tool_result(tool: str, arguments: Mapping[str, str]) -> dict[str, Any]:
    if tool == "read_file":
        path = arguments["path"]
        return {"path": path, "text": PROJECT_FILES.get(path, ""), "truncated": False}
    if tool == "list_directory":
        prefix = arguments["path"].rstrip("/") + "/"
        names = sorted({p[len(prefix) :].split("/")[0] for p in PROJECT_FILES if p.startswith(prefix)})
        return {"path": arguments["path"], "entries": [{"name": n, "kind": "file"} for n in names], "truncated": False}
    query = arguments["query"]
    matches = [
        {"path": path, "line": number, "text": line}
        for path, text in PROJECT_FILES.items()
        for number, line in enumerate(text.splitlines(), start=1)
        if query in line
    ]
    return {"query": query, "matches": matches, "searchedFiles": len(PROJECT_FILES), "truncated": False}


def _truncated_turn() -> list[dict[str, Any]]:
    """A search whose result the tool cut short (`"truncated": true`): the console shows its badge."""
    result = _tool_result("search_text", {"query": "e"})
    result["truncated"] = True
    return [
        {
            "role": "MESSAGE_ROLE_USER",
            "content": [{"text": "Search every file for the letter e, to see what is left."}],
        },
        {
            "role": "MESSAGE_ROLE_ASSISTANT",
            "content": [{"text": "That matches nearly everything; the search will be cut short."}],
            "toolCalls": [{"toolCallId": "web-wide", "name": "search_text", "arguments": json.dumps({"query": "e"})}],
        },
        {
            "role": "MESSAGE_ROLE_TOOL",
            "toolCallId": "web-wide",
            "content": [{"text": json.dumps(result)}],
        },
        {
            "role": "MESSAGE_ROLE_ASSISTANT",
            "content": [{"text": "The result was truncated, so I searched for `profile.name` instead (above)."}],
        },
    ]


def write_project(root: Path) -> None:
    """The demo project's files (kept as they are when they exist)."""
    for relative, text in PROJECT_FILES.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            path.write_text(text)


class DemoSeeder:
    """Seeds the demo through the gateway at `base_url` as the dev user."""

    def __init__(self, base_url: str, dev_token: str, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.client = httpx.Client(
            base_url=base_url,
            headers={"Authorization": f"Bearer {dev_token}"},
            timeout=REQUEST_TIMEOUT_SECONDS,
            trust_env=False,
        )

    def seed(self) -> None:
        """Create what is missing of the demo; raises httpx.HTTPError when the gateway refuses a step."""
        promise(self.data_dir)
        project = self.data_dir / PROJECT_DIRECTORY
        write_project(project)
        try:
            self._session(BACKEND_SESSION, "Rename name → displayName (server)", project)
            self._history(BACKEND_SESSION, list(_turns(_BACKEND_STEPS, BACKEND_TURNS, "server")))
            self._compact(BACKEND_SESSION)
            self._session(CLIENT_SESSION, "Rename name → displayName (web client)", project)
            self._history(CLIENT_SESSION, [*_turns(_CLIENT_STEPS, CLIENT_TURNS, "web"), _truncated_turn()])
        finally:
            self.client.close()
        (self.data_dir / PENDING_MARKER).unlink()

    def _session(self, session_id: str, title: str, project: Path) -> None:
        body = {"sessionId": session_id, "title": title, "workingDirectory": str(project)}
        self.client.post("/v1/sessions", json=body).raise_for_status()

    def _history(self, session_id: str, turns: list[list[dict[str, Any]]]) -> None:
        page = self.client.get(f"/v1/sessions/{session_id}/messages", params={"pageSize": 1})
        page.raise_for_status()
        if page.json()["messages"]:
            return  # appended by an earlier run
        # One batch, all or nothing: a failed run leaves the session empty, and the next run appends it whole.
        messages = [message for turn in turns for message in turn]
        self.client.post(f"/v1/sessions/{session_id}/messages", json={"messages": messages}).raise_for_status()

    def _compact(self, session_id: str) -> None:
        summary = self.client.get(f"/v1/sessions/{session_id}/compaction")
        summary.raise_for_status()
        if summary.json()["data"] is not None:
            return
        self.client.post(
            f"/v1/sessions/{session_id}/compaction:compactNow",
            json={"contextWindowTokens": str(COMPACTION_WINDOW_TOKENS)},
        ).raise_for_status()
