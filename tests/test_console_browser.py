"""The web console in a real browser (Debian's Chromium through Playwright) against a real `continuum up`.

One stack for the module, started in an empty data dir, so the demo workspace is seeded; the tests run
in order over it (each leaves the sessions idle), the last restarts the stack on the same ports. Every
main screen is saved as a screenshot under `.artifacts/console/`.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from deadline_testing import wait_for

from continuum_cli import demo

playwright_api = pytest.importorskip("playwright.sync_api")

pytestmark = [pytest.mark.browser, pytest.mark.timeout(600)]

CHROMIUM = Path("/usr/bin/chromium")
CONTINUUM = Path(sys.executable).parent / "continuum"
ARTIFACTS = Path(__file__).resolve().parents[1] / ".artifacts" / "console"
START_TIMEOUT = 120.0
UI_TIMEOUT_MS = 30_000
MERGE_TIMEOUT_MS = 180_000
COMPONENTS = ("transcript", "compaction", "agent", "merge")

if not CHROMIUM.exists():
    pytest.skip(f"{CHROMIUM} is missing (`make setup` installs it)", allow_module_level=True)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class Stack:
    """`continuum up` on a data dir and a fixed gateway port (so a restart keeps the console's URL)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data_dir = root / "data"
        self.gateway_port = free_port()
        self.output = root / "up.out"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def start(self, extra_env: dict[str, str] | None = None) -> None:
        env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("TRANSCRIPT_", "COMPACTION_", "MERGE_", "AGENT_", "GATEWAY_", "CONTINUUM_"))
        }
        # A readable pace, so a person (and this test) can see the answer arrive and stop it midway.
        env["AGENT_OFFLINE_DELTA_SECONDS"] = "0.12"
        env.update(extra_env or {})
        argv = [str(CONTINUUM), "up", "--data-dir", str(self.data_dir), f"--gateway-port={self.gateway_port}"]
        argv += [f"--{name}-port=0" for name in COMPONENTS]
        with open(self.output, "ab") as output:
            # Where this start's output begins (a restart appends to the same file).
            offset = output.tell()
            self.process = subprocess.Popen(argv, env=env, stdout=output, stderr=subprocess.STDOUT)

        def up() -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                pytest.fail(f"continuum up exited\n{self.output.read_text(errors='replace')}")
            return "Continuum is up" in self.output.read_text(errors="replace")[offset:]

        wait_for(up, what="continuum up's summary", seconds=START_TIMEOUT, diagnostics=self.diagnostics)

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def diagnostics(self) -> str:
        return self.output.read_text(errors="replace") if self.output.exists() else ""

    def token(self) -> str:
        return (self.data_dir / "dev-token").read_text().strip()

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {self.token()}"}, timeout=30, trust_env=False
        )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    started = Stack(tmp_path_factory.mktemp("console"))
    try:
        started.start()
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def page(browser: Any, stack: Stack) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    opened = context.new_page()
    opened.set_default_timeout(UI_TIMEOUT_MS)
    errors: list[str] = []
    opened.on("pageerror", lambda error: errors.append(str(error)))
    opened.goto(stack.url + "/")
    opened.fill("#token", stack.token())
    opened.click("#sign-in-form button")
    opened.wait_for_selector("a.session")
    yield opened
    context.close()
    assert not errors, errors


def shot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"))


def open_session(page: Any, session_id: str) -> None:
    page.click(f'a.session[href="#/s/{session_id}"]')
    page.wait_for_selector("#connection[data-state=live]")
    page.wait_for_selector("#transcript article.message")


def message_count(stack: Stack, session_id: str) -> int:
    count, after = 0, "0"
    with stack.client() as client:
        while True:
            page = client.get(f"/v1/sessions/{session_id}/messages", params={"after": after, "pageSize": 200}).json()
            count += len(page["messages"])
            if not page["messages"] or not page["nextPageToken"]:
                return count
            after = page["messages"][-1]["messageId"]


def test_the_demo_is_seeded_into_the_empty_data_dir_and_the_page_is_served_strictly(stack: Stack) -> None:
    with stack.client() as client:
        sessions = {s["sessionId"]: s for s in client.get("/v1/sessions").json()["sessions"]}
        page = client.get("/")
    assert {demo.BACKEND_SESSION, demo.CLIENT_SESSION} <= set(sessions)
    assert int(sessions[demo.BACKEND_SESSION]["compactionFenceMessageId"]) > 0, "the long session is compacted"
    assert sessions[demo.CLIENT_SESSION]["compactionFenceMessageId"] == "0"
    assert message_count(stack, demo.BACKEND_SESSION) == demo.BACKEND_TURNS * 4
    assert not (stack.data_dir / demo.PENDING_MARKER).exists()
    # Seeding again (as a run that found the marker of an interrupted seed would) adds nothing.
    demo.DemoSeeder(stack.url, stack.token(), stack.data_dir).seed()
    with stack.client() as client:
        again = client.get("/v1/sessions").json()["sessions"]
        events = client.get(f"/v1/sessions/{demo.BACKEND_SESSION}/compaction/events").json()["events"]
    assert sorted(s["sessionId"] for s in again) == sorted(sessions)
    assert message_count(stack, demo.BACKEND_SESSION) == demo.BACKEND_TURNS * 4
    assert len(events) == 1, "the compacted session is not compacted again"
    assert f"Console: {stack.url}/" in stack.diagnostics()
    assert page.status_code == 200
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["content-type"] == "text/html; charset=utf-8"


def test_sessions_are_created_renamed_and_deleted_from_the_tree(page: Any, stack: Stack) -> None:
    page.fill("#new-title", "Scratch session")
    page.click("#create-form button")
    page.wait_for_selector("#session-title:text('Scratch session')")
    page.once("dialog", lambda dialog: dialog.accept("Scratch, renamed"))
    page.click("#rename")
    page.wait_for_selector("a.session:text('Scratch, renamed')")
    session_id = page.evaluate("decodeURIComponent(location.hash.slice(4))")
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#delete")
    page.wait_for_selector("a.session:text('Scratch, renamed')", state="detached")
    with stack.client() as client:
        assert client.get(f"/v1/sessions/{session_id}").status_code == 404


def test_a_large_message_arrives_as_a_stub_and_its_body_loads_on_demand(page: Any, stack: Stack) -> None:
    body = "large body " * 8000 + "THE END"
    with stack.client() as client:
        created = client.post("/v1/sessions", json={"title": "Large message"}).json()["session"]["sessionId"]
        message = {"role": "MESSAGE_ROLE_USER", "content": [{"text": body}]}
        assert client.post(f"/v1/sessions/{created}/messages", json={"messages": [message]}).is_success
    page.reload()
    open_session(page, created)
    load = page.locator("button:text('Load the full message')")
    load.click()
    expect_text(page.locator("#transcript article.message.user .text"), "THE END")
    with stack.client() as client:
        assert client.delete(f"/v1/sessions/{created}").is_success


def test_every_control_has_a_name_and_the_tabs_work_from_the_keyboard(page: Any) -> None:
    open_session(page, demo.BACKEND_SESSION)
    unnamed = page.evaluate(
        """() => [...document.querySelectorAll("button, input, textarea, [role=tab], [role=switch]")]
            .filter((el) => el.offsetParent !== null)
            .filter((el) => !(el.getAttribute("aria-label") || el.textContent.trim()
                              || (el.labels && el.labels.length)))
            .map((el) => el.outerHTML.slice(0, 80))"""
    )
    assert unnamed == []
    page.focus("#tab-turns")
    page.keyboard.press("ArrowRight")
    assert page.evaluate("document.activeElement.id") == "tab-context"
    page.wait_for_selector("#panel-context", state="visible")
    page.keyboard.press("ArrowLeft")
    page.wait_for_selector("#panel-turns", state="visible")


def test_a_gateway_without_merge_or_agent_hides_the_merge_panel_and_makes_the_composer_read_only(
    browser: Any, stack: Stack, tmp_path: Path
) -> None:
    run = stack.data_dir / "run"
    env = {
        **os.environ,
        "GATEWAY_PORT": "0",
        "GATEWAY_DATA_DIR": str(tmp_path),
        "GATEWAY_TRANSCRIPT_ADDRESS": f"127.0.0.1:{(run / 'transcript.port').read_text().strip()}",
        "GATEWAY_COMPACTION_ADDRESS": f"127.0.0.1:{(run / 'compaction.port').read_text().strip()}",
        "GATEWAY_SERVICE_TOKEN": (stack.data_dir / "service-token").read_text().strip(),
        "GATEWAY_DEV_TOKEN": stack.token(),
    }
    with open(tmp_path / "gateway.log", "wb") as log:
        gateway = subprocess.Popen([sys.executable, "-m", "continuum_gateway"], env=env, stdout=log, stderr=log)
    try:
        port_file = tmp_path / "run" / "gateway.port"
        wait_for(port_file.exists, what="the second gateway's port file", seconds=60)
        context = browser.new_context(viewport={"width": 1400, "height": 900})
        page = context.new_page()
        page.goto(f"http://127.0.0.1:{port_file.read_text().strip()}/")
        page.fill("#token", stack.token())
        page.click("#sign-in-form button")
        page.wait_for_selector("a.session")
        assert page.locator("#open-merge").is_hidden()
        open_session(page, demo.CLIENT_SESSION)
        assert page.locator("#send").is_disabled()
        assert "no agent" in (page.get_attribute("#composer-text", "placeholder") or "")
        shot(page, "00-without-merge-and-agent")
        context.close()
    finally:
        gateway.send_signal(signal.SIGINT)
        gateway.wait(timeout=30)


def test_the_turn_rail_jumps_to_an_unloaded_turn_and_locate_finds_a_message_by_id(page: Any, stack: Stack) -> None:
    open_session(page, demo.BACKEND_SESSION)
    shot(page, "01-session")
    page.wait_for_selector("button.turn")
    assert page.locator("button.turn").count() == demo.BACKEND_TURNS
    # Turn 2 is far outside the live tail of 96 messages: it is not on screen until chosen.
    turn = page.locator("button.turn").nth(1)
    target = turn.get_attribute("data-message-id")
    assert page.locator(f"#message-{target}").count() == 0
    turn.click()
    page.wait_for_selector(f"#message-{target}.located")
    expect_visible(page, "#history-banner")
    shot(page, "02-turn-rail-jump")
    # Locate another early message by id, then go back to the live tail.
    located = int(target) + 6
    page.fill("#locate-id", str(located))
    page.click("#locate-form button")
    page.wait_for_selector(f"#message-{located}.located")
    page.click("#back-to-live")
    page.wait_for_selector("#history-banner", state="hidden")


def test_reading_older_history_keeps_at_most_three_pages_and_isolates_live_output(page: Any) -> None:
    open_session(page, demo.BACKEND_SESSION)
    # Scroll back through the whole history as a reader does (pages load as the top is reached),
    # recording the most messages the view ever holds: never more than three pages of 32.
    page.evaluate(
        """() => { window.mostShown = 0; const t = document.getElementById("transcript");
        new MutationObserver(() => { window.mostShown = Math.max(window.mostShown,
            t.querySelectorAll("article.message").length); }).observe(t, { childList: true }); }"""
    )
    for _ in range(20):
        if page.locator("text=Start of the conversation").count():
            break
        page.locator("#transcript").evaluate("t => { t.scrollTop = 0; t.dispatchEvent(new Event('scroll')); }")
        page.wait_for_timeout(300)
    page.wait_for_selector("#history-banner", state="visible")
    assert 0 < page.evaluate("window.mostShown") <= 3 * 32
    page.wait_for_selector("text=Start of the conversation")
    assert page.locator("#message-1").count() == 1
    assert page.locator("button.pager:text('Load newer messages')").count() == 1
    shot(page, "02b-older-pages")
    page.click("button.pager:text('Load newer messages')")
    assert page.locator("#transcript article.message").count() <= 3 * 32
    page.click("#back-to-live")
    page.wait_for_selector("#history-banner", state="hidden")


def test_the_record_store_installs_a_snapshot_whole_and_resyncs_on_a_gap(page: Any) -> None:
    outcome = page.evaluate(
        """async () => {
        const { RecordStore } = await import("/console/store.js");
        const store = new RecordStore(3);
        const g = "7";
        const frame = (type, body) => ({ type, streamGeneration: g, [type]: body });
        const message = (id, role = "MESSAGE_ROLE_USER") =>
            ({ messageId: String(id), role, content: [{ text: `m${id}` }], toolCalls: [] });
        const ref = { messageKey: "r.1", attempt: 1 };
        const seen = [];
        seen.push(store.apply(frame("handshake", { mode: "FOLLOW_MODE_BASELINE", durableSeq: "4" })));
        seen.push(store.apply(frame("snapshotBegin", { seq: "4", durableSeq: "4" })));
        seen.push(store.apply(frame("snapshotRecords", { messages: [message(1), message(2)], hasOlder: false })));
        const beforeEnd = store.messages.size;
        seen.push(store.apply(frame("snapshotRuntime", { runtimeState: { state: "RUN_STATE_RUNNING" } })));
        seen.push(store.apply(frame("snapshotPrefix",
                                    { attempt: ref, firstChunkIndex: 0, nextChunkIndex: 2, text: "Hel" })));
        seen.push(store.apply(frame("snapshotEnd", { seq: "4" })));  // installs everything at once
        const installed = store.messages.size;
        seen.push(store.apply(frame("chunk", { attempt: ref, chunkIndex: 2, text: "lo" })));
        seen.push(store.apply(frame("batch", { baseSeq: "4", seq: "5", messages: [message(3), message(4)] })));
        const evicted = !store.messages.has(1) && store.hasOlder
            && store.history.beforeMessageId === 2;
        const text = store.prefixes.get("r.1").text;
        const retry = store.apply(frame("attemptOpened", { messageKey: "r.1", attempt: 2 }));
        const retried = store.prefixes.get("r.1");
        const gap = store.apply(frame("chunk", { attempt: { messageKey: "r.1", attempt: 2 }, chunkIndex: 1,
                                                 text: "x" }));
        return { seen, beforeEnd, installed, evicted, text, retry, retried, gap, live: store.live };
    }"""
    )
    assert outcome["beforeEnd"] == 0, "nothing shows before the snapshot ends"
    assert outcome["installed"] == 2
    assert outcome["seen"] == ["applied"] * 8
    assert outcome["evicted"], "the store keeps its limit and points history before the oldest kept"
    assert outcome["text"] == "Hello"
    # A retry is a new attempt of the same message: its text starts over.
    assert outcome["retry"] == "applied"
    assert outcome["retried"] == {"attempt": 2, "nextChunkIndex": 0, "text": "", "retried": True}
    assert outcome["gap"] == {"resync": "chunk_gap", "resumable": False}
    assert outcome["live"] is False


def test_editing_a_compacted_message_is_refused_with_an_explanation(page: Any) -> None:
    open_session(page, demo.BACKEND_SESSION)
    page.wait_for_selector("button.turn")
    first = page.locator("button.turn").first.get_attribute("data-message-id")
    page.locator("button.turn").first.click()
    message = page.locator(f"#message-{first}")
    message.locator("button.edit").click()
    message.locator("textarea").fill("Rename it to fullName instead.")
    message.locator("button[type=submit]").click()
    expect_text(message.locator(".error"), "already covered by the session's summary")
    shot(page, "03-edit-refused")


def test_memory_switch_changes_the_session_from_the_next_run(page: Any, stack: Stack) -> None:
    open_session(page, demo.CLIENT_SESSION)
    page.click("#tab-context")
    expect_text(page.locator("#panel-context"), "Applies from the next run")
    page.uncheck("#memory-switch")
    expect_text(page.locator("#panel-context"), "Memory injection is off.")
    with stack.client() as client:
        assert client.get(f"/v1/sessions/{demo.CLIENT_SESSION}").json()["session"]["memoryInjectionDisabled"] is True
    page.check("#memory-switch")
    expect_text(page.locator("#panel-context"), "Memory injection is on.")
    with stack.client() as client:
        assert client.get(f"/v1/sessions/{demo.CLIENT_SESSION}").json()["session"]["memoryInjectionDisabled"] is False


def test_a_turn_started_in_one_page_runs_in_another_before_its_text_streams_and_is_idle_after(
    browser: Any, page: Any, stack: Stack
) -> None:
    open_session(page, demo.CLIENT_SESSION)
    other = browser.new_context(viewport={"width": 1400, "height": 900})
    watcher = other.new_page()
    watcher.set_default_timeout(UI_TIMEOUT_MS)
    watcher.goto(stack.url + "/")
    watcher.fill("#token", stack.token())
    watcher.click("#sign-in-form button")
    watcher.wait_for_selector("a.session")
    open_session(watcher, demo.CLIENT_SESSION)
    assert watcher.get_attribute("#run-state", "data-running") == "false"
    # Record, in the second page, what was on screen when it first showed the turn running.
    watcher.evaluate(
        """() => { window.firstRunning = null; const state = document.getElementById("run-state");
        new MutationObserver(() => {
            if (window.firstRunning || state.dataset.running !== "true") return;
            window.firstRunning = { source: state.dataset.source, runId: state.dataset.runId,
                streaming: !!document.querySelector(".message.streaming") };
        }).observe(state, { attributes: true }); }"""
    )
    with page.expect_response(lambda r: r.url.endswith("/turns") and r.request.method == "POST") as answer:
        page.fill("#composer-text", "Which files mention displayName?")
        page.keyboard.press("Enter")
    run_id = answer.value.json()["runId"]

    watcher.wait_for_selector("#run-state[data-running=true]")
    first = watcher.evaluate("window.firstRunning")
    assert first == {"source": "runtime", "runId": run_id, "streaming": False}
    assert watcher.get_attribute("#run-state", "title") == f"Run {run_id}"
    watcher.wait_for_selector(".message.streaming")
    shot(watcher, "04a-running-in-a-second-page")
    watcher.wait_for_selector("#run-state[data-running=false][data-source=runtime]", timeout=60_000)
    expect_text(watcher.locator("#run-state"), "Idle (last turn completed)")
    assert watcher.locator(".message.streaming").count() == 0
    page.wait_for_selector("#run-state[data-running=false]")
    other.close()


def test_memory_chips_show_the_entries_of_the_last_request_and_none_once_memory_is_off(page: Any) -> None:
    entries = demo.PROJECT_FILES["MEMORY.md"].count("\n- ")
    open_session(page, demo.CLIENT_SESSION)
    page.click("#tab-context")
    # The turn of the previous test carried the demo project's MEMORY.md (the manifest is kept per tab,
    # so this page sees it only from a run it watched): run one here.
    page.fill("#composer-text", "What do you remember about this project?")
    page.keyboard.press("Enter")
    page.wait_for_selector("#run-state[data-running=true]")
    page.wait_for_selector("#run-state[data-running=false]", timeout=60_000)
    page.wait_for_selector(f"#memory-entries[data-count='{entries}']")
    chips = page.locator("ul.chips li.chip")
    assert chips.count() == entries
    assert all(re.fullmatch(r"mem-[0-9a-f]{16}", text) for text in chips.all_inner_texts())
    expect_text(page.locator("#memory-entries"), f"{entries} memory entries were in the last request")
    shot(page, "06a-memory-chips")

    page.uncheck("#memory-switch")
    expect_text(page.locator("#panel-context"), "Memory injection is off.")
    page.fill("#composer-text", "And now, without memory?")
    page.keyboard.press("Enter")
    page.wait_for_selector("#run-state[data-running=true]")
    page.wait_for_selector("#run-state[data-running=false]", timeout=60_000)
    page.wait_for_selector("#memory-entries[data-count='0']")
    assert page.locator("ul.chips li.chip").count() == 0
    expect_text(page.locator("#memory-entries"), "Memory injection is off for this session.")
    page.check("#memory-switch")
    expect_text(page.locator("#panel-context"), "Memory injection is on.")


def test_a_reply_streams_live_and_stop_keeps_it_as_interrupted(page: Any) -> None:
    open_session(page, demo.CLIENT_SESSION)
    page.fill("#composer-text", "Where does the web client show profile.name?")
    page.keyboard.press("Enter")
    streaming = page.locator(".message.streaming")
    streaming.wait_for()
    first = streaming.locator(".text").inner_text()
    page.wait_for_function(
        "([before]) => { const s = document.querySelector('.message.streaming .text');"
        " return s && s.textContent.length > before.length; }",
        arg=[first],
    )
    shot(page, "04-streaming")
    # The whole first turn completes (a tool round and the answer), then a second one is stopped midway.
    page.wait_for_selector("#stop", state="hidden")
    page.wait_for_selector(".message.streaming", state="detached")
    page.fill("#composer-text", "Now check web/settings.js as well, please.")
    page.keyboard.press("Enter")
    page.wait_for_selector(".message.streaming")
    page.click("#stop")
    page.wait_for_selector(".badge.warn:text('interrupted')")
    page.wait_for_selector("#stop", state="hidden")
    expect_text(page.locator("#run-state[data-source=runtime]"), "Idle (last turn stopped)")
    shot(page, "05-stopped")


def test_an_edit_rewrites_history_and_the_view_resyncs_without_a_flash(page: Any) -> None:
    open_session(page, demo.CLIENT_SESSION)
    # Count, from now on, every moment the transcript shows no message at all.
    page.evaluate(
        """() => { window.emptyMoments = 0; const t = document.getElementById("transcript");
        new MutationObserver(() => { if (!t.querySelector("article.message")) window.emptyMoments += 1; })
            .observe(t, { childList: true, subtree: true }); }"""
    )
    last_user = page.locator("#transcript article.message.user").last
    last_user.locator("button.edit").click()
    last_user.locator("textarea").fill("Check web/settings.js and web/profile.js, please.")
    last_user.locator("button[type=submit]").click()
    page.wait_for_selector("#transcript article.message.user .text:text('web/profile.js, please.')")
    page.wait_for_selector("#connection[data-state=live]")
    assert page.evaluate("window.emptyMoments") == 0
    # The interrupted answer after the edited message is gone with the rewrite.
    expect_text(page.locator("#transcript article.message").last, "Check web/settings.js and web/profile.js")


def test_compact_now_while_idle_and_while_a_turn_runs(page: Any) -> None:
    open_session(page, demo.CLIENT_SESSION)
    page.click("#tab-context")
    page.click("#compact-now")
    expect_text(page.locator("#compact-state"), "Done:")
    page.wait_for_selector(".marker")
    page.locator("#last-summary summary").click()
    expect_text(page.locator("#last-summary"), "Version 1")
    shot(page, "06-context-tab")
    # While running: the compaction is queued for the turn's next tool-round boundary.
    page.fill("#composer-text", "List the server folder again, step by step.")
    page.keyboard.press("Enter")
    page.wait_for_selector("#stop", state="visible")
    page.click("#compact-now")
    expect_text(page.locator("#compact-state"), "Queued")
    shot(page, "07-compact-queued")
    page.wait_for_selector("#stop", state="hidden", timeout=60_000)


def test_merging_the_two_demo_sessions_end_to_end_and_opening_the_target(page: Any) -> None:
    page.click("#open-merge")
    page.check(f"#src-{demo.BACKEND_SESSION}")
    page.check(f"#src-{demo.CLIENT_SESSION}")
    page.locator(f"input[name=primary][value={demo.BACKEND_SESSION}]").check()
    page.fill("#merge-title-input", "Rename name → displayName (merged)")
    page.click("#start-merge")
    page.wait_for_selector(".merge-progress")
    shot(page, "08-merge-running")
    page.wait_for_selector("#open-target", timeout=MERGE_TIMEOUT_MS)
    expect_text(page.locator(".merge-progress"), "Completed")
    shot(page, "09-merge-completed")
    page.click("#open-target")
    page.wait_for_selector("#provenance:not([hidden])")
    expect_text(page.locator("#provenance"), "Merged from")
    page.wait_for_selector("#connection[data-state=live]")
    shot(page, "10-merged-session")


def test_the_console_reconnects_after_the_gateway_restarts_and_the_seed_is_not_repeated(
    page: Any, stack: Stack
) -> None:
    open_session(page, demo.CLIENT_SESSION)
    before = message_count(stack, demo.BACKEND_SESSION)
    stack.stop()
    page.wait_for_selector("#connection[data-state=reconnecting]")
    expect_text(page.locator("#run-state"), "the connection is down")
    shot(page, "11-reconnecting")
    # Restarted with a disk reserve no disk has: merges started from now on pause (the next test).
    stack.start(extra_env={"MERGE_DISK_RESERVE_BYTES": str(2**62)})
    page.wait_for_selector("#connection[data-state=live]", timeout=60_000)
    # The data dir was not empty: nothing was seeded again.
    assert "seeding the demo" not in stack.diagnostics().rsplit("continuum: starting transcript", 1)[-1]
    assert message_count(stack, demo.BACKEND_SESSION) == before
    # And the reconnected view is live: a new turn streams in.
    page.fill("#composer-text", "Are we connected again?")
    page.keyboard.press("Enter")
    page.wait_for_selector('text=You asked: "Are we connected again?"', timeout=60_000)
    shot(page, "12-reconnected")


def expect_visible(page: Any, selector: str) -> None:
    page.wait_for_selector(selector, state="visible")


def expect_text(locator: Any, text: str) -> None:
    """Wait until `locator`'s text contains `text` (Playwright's own wait, as patient as every other UI wait:
    its 5 s default failed a loaded CI run while a summary was still loading)."""
    playwright_api.expect(locator).to_contain_text(re.compile(re.escape(text)), timeout=UI_TIMEOUT_MS)


def test_a_paused_merge_shows_why_survives_a_reload_and_resumes_or_cancels_by_epoch(page: Any) -> None:
    page.click("#open-merge")
    page.check(f"#src-{demo.BACKEND_SESSION}")
    page.check(f"#src-{demo.CLIENT_SESSION}")
    page.locator(f"input[name=primary][value={demo.CLIENT_SESSION}]").check()
    # The last test's turn may still be releasing its session: a busy source is refused and explained,
    # and starting again once it is idle works.
    deadline = time.monotonic() + 60
    page.click("#start-merge")
    while page.locator(".merge-progress").count() == 0:
        page.wait_for_selector(".merge-progress, #merge-form .error:not(:empty)")
        if page.locator(".merge-progress").count():
            break
        refusal = page.inner_text("#merge-form .error")
        assert "MERGE_SOURCE_BUSY" in refusal, refusal
        assert time.monotonic() < deadline, "the sources stayed busy"
        page.wait_for_timeout(1000)
        page.click("#start-merge")  # clears the refusal; the next one (or the progress) follows
    progress = page.locator(".merge-progress")
    expect_text(progress, "Paused because")
    expect_text(progress, "Disk reserve")
    epoch = page.locator("#resume-merge").inner_text()
    shot(page, "13-merge-paused")
    # A reload (or another tab) finds the unfinished merge again and reopens the panel on it.
    page.reload()
    page.wait_for_selector("#merge-dialog[open] .merge-progress")
    expect_text(page.locator(".merge-progress"), "Paused because")
    # Resume at the epoch seen: it runs again (a new epoch) and pauses again for the same reason.
    page.click("#resume-merge")
    page.wait_for_function(
        "([before]) => { const b = document.getElementById('resume-merge'); return b && b.textContent !== before; }",
        arg=[epoch],
    )
    page.click("#cancel-merge")
    expect_text(page.locator(".merge-progress"), "Cancelled")
    expect_text(page.locator(".merge-progress"), "Sessions held")
    assert page.locator(".merge-progress dd").nth(4).inner_text() == "none"
    shot(page, "14-merge-cancelled")
