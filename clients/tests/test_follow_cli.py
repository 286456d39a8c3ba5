"""`continuum follow`: a session printed live by the real command, Ctrl-C, and its refusals."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
from deadline_testing import deadline, within
from follow_testing import TOKEN, USER, Live, assistant, running, user

from continuum_cli.follow import TOKEN_ENV, resolve_address
from continuum_cli.main import build_parser, main

CONTINUUM = Path(sys.executable).parent / "continuum"


class Output:
    """Collects a child's stdout as it arrives."""

    def __init__(self, stream: asyncio.StreamReader) -> None:
        self.text = ""
        self._task = asyncio.create_task(self._read(stream))

    async def _read(self, stream: asyncio.StreamReader) -> None:
        while data := await stream.read(4096):
            self.text += data.decode()

    async def shows(self, expected: str, seconds: float = 15.0) -> None:
        """Wait until the output contains `expected`."""
        async with deadline(seconds, lambda: f"{expected!r} in the output {self.text!r}"):
            # Polling: the output grows in another task.
            while expected not in self.text:  # noqa: ASYNC110
                await asyncio.sleep(0.02)

    async def finish(self) -> str:
        """Everything, once the stream closed."""
        await within(self._task, 10, lambda: f"the command's output to end after {self.text!r}")
        return self.text


async def follow_command(live: Live, session_id: str) -> asyncio.subprocess.Process:
    """`continuum follow` as an operator runs it, with the token in its environment."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env[TOKEN_ENV] = TOKEN
    return await asyncio.create_subprocess_exec(
        str(CONTINUUM),
        "follow",
        session_id,
        "--address",
        live.address,
        "--user",
        USER,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def test_follow_prints_the_session_live_and_ctrl_c_exits_0(tmp_path: Path) -> None:
    async with running(tmp_path) as live:
        session = await live.session()
        await live.append(session, user("hello"))
        process = await follow_command(live, session)
        assert process.stdout is not None and process.stderr is not None
        output = Output(process.stdout)
        try:
            await output.shows("user: hello\n")
            await live.open(session, "m1")
            await live.chunks(session, "m1", 1, 0, "Hel")
            await output.shows("assistant: Hel")
            await live.chunks(session, "m1", 1, 1, "lo")
            await output.shows("assistant: Hello")
            await live.commit(session, "m1", 1, assistant("Hello!", "c1"))
            await output.shows('assistant: Hello!\n  → tool shell({"cmd": "ls"})\n')
        finally:
            process.send_signal(signal.SIGINT)
            code = await within(process.wait(), 10, "`continuum follow` to exit on Ctrl-C")
        assert code == 0, await process.stderr.read()
        assert (await output.finish()).count("assistant: ") == 1


async def test_follow_of_a_missing_session_exits_1_with_the_reason(tmp_path: Path) -> None:
    async with running(tmp_path) as live:
        process = await follow_command(live, "no-such-session")
        _, stderr = await within(process.communicate(), 15, "`continuum follow` to exit on a missing session")

    assert process.returncode == 1
    assert "SESSION_NOT_FOUND" in stderr.decode()


def test_follow_without_a_token_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.delenv("MY_TOKEN", raising=False)
    # No local run's data dir to find a token in (./.continuum from here).
    monkeypatch.delenv("CONTINUUM_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)

    assert main(["follow", "s1", "--token-env", "MY_TOKEN"]) == 2
    assert "set MY_TOKEN" in capsys.readouterr().err


def test_follow_options_default_to_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CONTINUUM_TRANSCRIPT_ADDRESS", "10.0.0.1:7")
    args = build_parser().parse_args(["follow", "s1"])
    assert (args.session_id, args.token_env, args.user) == ("s1", TOKEN_ENV, "dev")
    assert resolve_address(args.address, tmp_path) == "10.0.0.1:7"

    monkeypatch.delenv("CONTINUUM_TRANSCRIPT_ADDRESS")
    assert resolve_address(build_parser().parse_args(["follow", "s1"]).address, tmp_path) == "127.0.0.1:50151"
