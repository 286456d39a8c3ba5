"""The model the loop talks to: history and tool definitions in, text deltas and tool calls out.

Two implementations: `OfflineModel`, a deterministic script that needs no key and no network and does
one tool round per turn (list the directory, search for the user's longest word, list the merged
sources' archive with HandoffRead when it is offered, then answer from the results), and
`OpenAIChatModel`, a client of any OpenAI-compatible chat-completions server with tools.
Failures are `ProviderError`s of the shared runtime; logs carry statuses and attempts, never text.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from continuum.transcript.v1 import resources_pb2 as tpb
from continuum_agent import tools
from continuum_runtime.provider import ProviderBadResponse, ProviderOutputTruncated, ProviderSettings
from continuum_runtime.provider.openai_http import ChatAnswer, post_chat_completion
from continuum_runtime.wire_names import HANDOFF_READ_TOOL

OFFLINE_MODEL_NAME = "continuum-offline-agent"
Sleep = Callable[[float], Awaitable[None]]


@dataclass(frozen=True)
class ToolRequest:
    """One tool call the model asked for."""

    call_id: str
    name: str
    arguments: str = field(repr=False)


@dataclass(frozen=True)
class Reply:
    """One model answer: its text as streamed pieces, and the tool calls to run before the next request."""

    deltas: list[str] = field(repr=False)
    tool_calls: list[ToolRequest]
    # Pause before each piece is shown (the offline model writes at a readable pace; 0 otherwise).
    delta_seconds: float = 0.0

    @property
    def text(self) -> str:
        """The whole answer."""
        return "".join(self.deltas)


class AgentModel(Protocol):
    """A model that can call tools."""

    @property
    def name(self) -> str:
        """Which implementation (safe to log)."""
        ...

    async def reply(
        self, system_prompt: str, history: Sequence[tpb.Message], definitions: Sequence[dict[str, Any]]
    ) -> Reply:
        """The next answer to `history` (compaction's context, summary first when there is one), with the
        tools of `definitions` (OpenAI-style) on offer."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...


def message_text(message: tpb.Message) -> str:
    """The text parts of a message, joined."""
    return "".join(part.text for part in message.content if part.WhichOneof("part") == "text")


def _words(text: str) -> list[str]:
    """`text` as streamed pieces: each word with the space after it."""
    return re.findall(r"\S+\s*|\s+", text)


class OfflineModel:
    """The deterministic script: a USER message last → one tool round; a TOOL result last → the answer."""

    name = "offline"

    def __init__(self, delta_seconds: float) -> None:
        self._delta_seconds = delta_seconds

    async def reply(
        self, system_prompt: str, history: Sequence[tpb.Message], definitions: Sequence[dict[str, Any]]
    ) -> Reply:
        """See `AgentModel.reply`."""
        last_user = next((m for m in reversed(history) if m.role == tpb.MESSAGE_ROLE_USER), None)
        question = message_text(last_user) if last_user is not None else ""
        results = []
        for message in reversed(history):
            if message.role != tpb.MESSAGE_ROLE_TOOL:
                break
            results.append(message)
        if not results:
            calls = [ToolRequest("list-1", tools.LIST_DIRECTORY, json.dumps({"path": "."}))]
            word = _longest_word(question)
            if word:
                calls.append(ToolRequest("search-1", tools.SEARCH_TEXT, json.dumps({"query": word})))
            if any(definition["function"]["name"] == HANDOFF_READ_TOOL for definition in definitions):
                calls.append(ToolRequest("handoff-1", HANDOFF_READ_TOOL, json.dumps({"action": "list"})))
            text = "Let me look at the working directory first."
            return Reply(_words(text), calls, self._delta_seconds)
        lines = [_describe(message_text(result)) for result in reversed(results)]
        excerpt = " ".join(question.split())[:160]
        text = (
            f"Here is what I found. {' '.join(lines)} "
            f'You asked: "{excerpt}". '
            "I am the built-in offline model, so this answer is a deterministic script: "
            "configure an OpenAI-compatible provider (AGENT_PROVIDER__KIND=openai) for real answers."
        )
        return Reply(_words(text), [], self._delta_seconds)

    async def aclose(self) -> None:
        """Nothing to release."""
        return None


def _longest_word(text: str) -> str:
    words = re.findall(r"[A-Za-z_][A-Za-z0-9_]{2,63}", text)
    return max(words, key=len) if words else ""


def _describe(result: str) -> str:
    """One sentence about a tool result."""
    try:
        parsed = json.loads(result)
    except ValueError:
        return "A tool answered something I could not read."
    if not isinstance(parsed, dict):
        return "A tool answered something I could not read."
    if "error" in parsed:
        return f"A tool was refused: {str(parsed['error'])[:200]}."
    suffix = " (the result was truncated)" if parsed.get("truncated") else ""
    if "packageVersion" in parsed:
        more = "" if parsed.get("complete") else "; there is more to read"
        return f"The merged sources' archive answered {len(parsed.get('entries', []))} entries{suffix}{more}."
    if "entries" in parsed:
        names = [str(entry.get("name", "")) for entry in parsed["entries"][:8] if isinstance(entry, dict)]
        shown = ", ".join(names) if names else "nothing"
        return f"The directory holds {len(parsed['entries'])} entries{suffix}: {shown}."
    if "matches" in parsed:
        matches = parsed["matches"]
        if not matches:
            return f'No line contains "{parsed.get("query", "")}"{suffix}.'
        first = matches[0]
        return (
            f'{len(matches)} line(s) contain "{parsed.get("query", "")}"{suffix}, '
            f"the first in {first.get('path')} at line {first.get('line')}."
        )
    if "text" in parsed:
        return f"{parsed.get('path')} holds {len(str(parsed['text']))} characters{suffix}."
    return "A tool answered."


_ROLES = {
    tpb.MESSAGE_ROLE_USER: "user",
    tpb.MESSAGE_ROLE_ASSISTANT: "assistant",
    tpb.MESSAGE_ROLE_TOOL: "tool",
    tpb.MESSAGE_ROLE_SYSTEM: "system",
}


def chat_messages(system_prompt: str, history: Sequence[tpb.Message]) -> list[dict[str, Any]]:
    """The OpenAI chat-completions `messages` of a request."""
    messages: list[dict[str, Any]] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    for message in history:
        role = _ROLES.get(message.role)
        if role is None:
            continue
        entry: dict[str, Any] = {"role": role, "content": message_text(message)}
        if message.role == tpb.MESSAGE_ROLE_ASSISTANT and message.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": call.tool_call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in message.tool_calls
            ]
        if message.role == tpb.MESSAGE_ROLE_TOOL:
            entry["tool_call_id"] = message.tool_call_id
        messages.append(entry)
    return messages


class OpenAIChatModel:
    """POSTs `{base_url}/chat/completions` with the tool definitions, under the runtime's one retry policy
    and response byte limit (`post_chat_completion`)."""

    name = "openai-compatible"

    def __init__(
        self,
        settings: ProviderSettings,
        *,
        sleep: Sleep = asyncio.sleep,
        transport: httpx.AsyncBaseTransport | None = None,
        chunk_max_chars: int = 4096,
    ) -> None:
        if not settings.base_url.startswith(("http://", "https://")) or not settings.model:
            raise ValueError("provider kind 'openai' needs an http(s) base_url and a model")
        self._settings = settings
        self._url = settings.base_url.rstrip("/") + "/chat/completions"
        self._sleep = sleep
        self._chunk = chunk_max_chars
        headers = {"Accept": "application/json"}
        if api_key := settings.api_key.get_secret_value():
            headers["Authorization"] = f"Bearer {api_key}"
        timeout = httpx.Timeout(settings.read_timeout_seconds, connect=settings.connect_timeout_seconds)
        self._client = httpx.AsyncClient(headers=headers, timeout=timeout, transport=transport)

    def __repr__(self) -> str:
        return f"OpenAIChatModel(model={self._settings.model!r})"

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()

    async def reply(
        self, system_prompt: str, history: Sequence[tpb.Message], definitions: Sequence[dict[str, Any]]
    ) -> Reply:
        """See `AgentModel.reply`."""
        body = {
            "model": self._settings.model,
            "messages": chat_messages(system_prompt, history),
            "tools": list(definitions),
        }
        answer = await post_chat_completion(
            self._client, self._url, body, self._settings, sleep=self._sleep, provider=self.name
        )
        return self._parse(answer)

    def _parse(self, answer: ChatAnswer) -> Reply:
        payload, status = answer.payload, answer.status
        choices = payload.get("choices") if isinstance(payload, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise ProviderBadResponse("chat completion response has no choices", status=status)
        choice = choices[0]
        if choice.get("finish_reason") == "length":
            raise ProviderOutputTruncated("chat completion hit the output token limit", status=status)
        message = choice.get("message")
        if not isinstance(message, dict):
            raise ProviderBadResponse("chat completion response has no message", status=status)
        content = message.get("content") or ""
        if not isinstance(content, str):
            raise ProviderBadResponse("chat completion content is not text", status=status)
        calls: list[ToolRequest] = []
        raw_calls = message.get("tool_calls") or []
        if not isinstance(raw_calls, list):
            raise ProviderBadResponse("chat completion tool_calls is not a list", status=status)
        for index, raw in enumerate(raw_calls):
            function = raw.get("function") if isinstance(raw, dict) else None
            name = function.get("name") if isinstance(function, dict) else None
            if not isinstance(name, str) or not name:
                raise ProviderBadResponse("a tool call has no function name", status=status)
            arguments = function.get("arguments") if isinstance(function, dict) else ""
            call_id = raw.get("id") if isinstance(raw.get("id"), str) and raw.get("id") else f"call-{index + 1}"
            calls.append(ToolRequest(call_id[:256], name[:256], arguments if isinstance(arguments, str) else ""))
        if not content and not calls:
            raise ProviderBadResponse("chat completion has neither content nor tool calls", status=status)
        deltas = [content[i : i + self._chunk] for i in range(0, len(content), self._chunk)]
        return Reply(deltas, calls)


def open_model(settings: ProviderSettings, delta_seconds: float, chunk_max_chars: int) -> AgentModel:
    """The model the settings name: offline by default."""
    if settings.kind == "openai":
        return OpenAIChatModel(settings, chunk_max_chars=chunk_max_chars)
    return OfflineModel(delta_seconds)
