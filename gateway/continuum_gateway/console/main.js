// The console's page: sign-in, the session tree, and one open session (transcript, turn rail,
// composer, context tab), plus the merge panel when the gateway has `merge-v2`.

import { ApiError, call, explain, newId, storedToken, storeToken } from "./api.js";
import { ContextTab } from "./context.js";
import { $, h } from "./dom.js";
import { FollowConnection } from "./follow.js";
import { MergePanel } from "./merge.js";
import { TurnRail } from "./outline.js";
import { RecordStore } from "./store.js";
import { TranscriptView } from "./transcript.js";

const state = {
  capabilities: [],
  sessions: [],
  merges: new Map(), // merged session id -> its operation's parameters (provenance)
  open: null, // {session, store, follow, view, rail, context}
  expanded: new Set(),
};

const CONNECTION_TEXT = {
  connecting: "Connecting…",
  live: "Live",
  resyncing: "Refreshing the view…",
  reconnecting: "Connection lost: reconnecting",
  offline: "Offline: waiting for the network",
  refused: "Not allowed to follow this session",
};

function showSignIn(message = "") {
  $("sign-in").hidden = false;
  $("workspace").hidden = true;
  $("sign-out").hidden = true;
  $("sign-in-error").textContent = message;
  $("token").focus();
}

async function signIn(token) {
  storeToken(token);
  try {
    state.capabilities = (await call("GET", "/v1/capabilities")).capabilities;
  } catch (error) {
    storeToken("");
    showSignIn(error instanceof ApiError && error.status === 401 ? "That token is not valid here." : explain(error));
    return;
  }
  $("sign-in").hidden = true;
  $("workspace").hidden = false;
  $("sign-out").hidden = false;
  $("open-merge").hidden = !state.capabilities.includes("merge-v2");
  await loadSessions();
  const wanted = decodeURIComponent(location.hash.replace(/^#\/s\//, ""));
  if (wanted && wanted !== location.hash) await openSession(wanted);
  if (state.capabilities.includes("merge-v2")) recoverMerge();
}

// Sessions

async function loadSessions() {
  const sessions = [];
  let pageToken = "";
  // A user's list, bounded: at most 5 pages of 200 in the tree (the rest stay reachable by URL).
  for (let page = 0; page < 5; page += 1) {
    const answer = await call("GET", "/v1/sessions", { query: { pageSize: 200, pageToken } });
    sessions.push(...answer.sessions);
    pageToken = answer.nextPageToken;
    if (!pageToken) break;
  }
  state.sessions = sessions;
  await Promise.all(sessions.filter((s) => s.kind === "SESSION_KIND_MERGED" && !state.merges.has(s.sessionId)).map(loadProvenance));
  renderTree();
}

async function loadProvenance(session) {
  const operationId = session.metadata && session.metadata.sessionMergeOperationId;
  if (!operationId || !state.capabilities.includes("merge-v2")) return;
  try {
    const answer = await call("GET", `/v1/session-merges/${encodeURIComponent(operationId)}`);
    state.merges.set(session.sessionId, answer.operation.parameters);
  } catch {
    // Provenance is a nicety; the session itself is still listed.
  }
}

function titleOf(id) {
  const session = state.sessions.find((s) => s.sessionId === id);
  return session ? session.title || session.sessionId : id;
}

function renderTree() {
  const children = new Map();
  for (const session of state.sessions) {
    const parent = session.parentSessionId || "";
    if (!children.has(parent)) children.set(parent, []);
    children.get(parent).push(session);
  }
  const known = new Set(state.sessions.map((s) => s.sessionId));
  const item = (session) => {
    const kids = children.get(session.sessionId) || [];
    const current = state.open && state.open.session.sessionId === session.sessionId;
    const sources = state.merges.get(session.sessionId);
    const row = h("div", { class: "tree-row" },
      kids.length
        ? h("button", { type: "button", class: "twisty", "aria-expanded": String(state.expanded.has(session.sessionId)), "aria-label": `Show the children of ${session.title || session.sessionId}`,
            onclick: () => { toggle(state.expanded, session.sessionId); renderTree(); } }, state.expanded.has(session.sessionId) ? "▾" : "▸")
        : h("span", { class: "twisty-space" }),
      h("a", { href: `#/s/${encodeURIComponent(session.sessionId)}`, class: current ? "session current" : "session", "aria-current": current ? "page" : null },
        session.title || "(untitled)",
        session.kind === "SESSION_KIND_MERGED" ? h("span", { class: "badge" }, "merged") : null));
    const li = h("li", {}, row);
    if (sources) li.append(h("p", { class: "provenance-line" }, "from ", sources.sourceSessionIds.map(titleOf).join(" + ")));
    if (kids.length && state.expanded.has(session.sessionId)) li.append(h("ul", { class: "tree" }, kids.map(item)));
    return li;
  };
  const roots = state.sessions.filter((s) => !s.parentSessionId || !known.has(s.parentSessionId));
  $("session-tree").replaceChildren(...(roots.length ? roots.map(item) : [h("li", { class: "note" }, "No sessions yet.")]));
}

function toggle(set, value) {
  if (set.has(value)) set.delete(value);
  else set.add(value);
}

// One open session

function closeSession() {
  if (!state.open) return;
  state.open.follow.close();
  clearTimeout(state.open.railTimer);
  state.open = null;
}

async function openSession(sessionId) {
  closeSession();
  let session;
  try {
    session = (await call("GET", `/v1/sessions/${encodeURIComponent(sessionId)}`)).session;
  } catch (error) {
    $("empty-state").replaceChildren(h("p", { class: "error" }, explain(error)));
    $("empty-state").hidden = false;
    $("session-view").hidden = true;
    return;
  }
  if (location.hash !== `#/s/${encodeURIComponent(sessionId)}`) history.replaceState(null, "", `#/s/${encodeURIComponent(sessionId)}`);
  $("empty-state").hidden = true;
  $("session-view").hidden = false;
  const store = new RecordStore();
  const open = { session, store };
  state.open = open;
  open.view = new TranscriptView(session, store, {
    onEdited: () => refreshSession(),
    onLoadedChange: () => open.rail && open.rail.render(open.view.loadedIds()),
  });
  open.rail = new TurnRail(sessionId, { locate: (id) => locate(id) });
  open.context = new ContextTab(session, store, {
    onSessionChanged: (changed) => (changed ? setSession(changed) : refreshSession()),
    onMarker: (boundary, mode) => {
      open.view.addMarker(boundary, mode);
      open.view.render();
    },
  });
  renderHead();
  renderTree();
  let lastUserCount = -1;
  open.follow = new FollowConnection(sessionId, store, {
    onChange: (kind) => {
      if (state.open !== open) return;
      open.view.render(kind);
      open.context.absorb();
      renderRunState();
      // New turns (or an edit's fresh baseline) change the outline: read it again, a moment later.
      const users = [...store.messages.values()].filter((m) => m.role === "MESSAGE_ROLE_USER").length;
      if (kind === "install" || users !== lastUserCount) {
        lastUserCount = users;
        clearTimeout(open.railTimer);
        open.railTimer = setTimeout(() => open.rail.refresh(), 300);
      }
      if (kind === "install" && open.firstInstall === undefined) {
        open.firstInstall = true;
        open.view.container.scrollTop = open.view.container.scrollHeight;
      }
    },
    onState: (connection, detail) => {
      if (state.open !== open) return;
      open.connection = connection;
      const suffix = detail.attempt && connection === "reconnecting" ? ` (attempt ${detail.attempt})` : "";
      const element = $("connection");
      element.textContent = (CONNECTION_TEXT[connection] || connection) + suffix;
      element.dataset.state = connection;
      renderRunState();
    },
  });
  await open.context.loadHistory();
  open.context.render();
  open.follow.start();
  open.rail.refresh();
}

function setSession(session) {
  const open = state.open;
  if (!open || open.session.sessionId !== session.sessionId) return;
  open.session = session;
  open.view.session = session;
  open.context.session = session;
  const index = state.sessions.findIndex((s) => s.sessionId === session.sessionId);
  if (index >= 0) state.sessions[index] = session;
  renderHead();
  renderTree();
  open.view.render();
  open.context.render();
}

async function refreshSession() {
  const open = state.open;
  if (!open) return;
  try {
    setSession((await call("GET", `/v1/sessions/${encodeURIComponent(open.session.sessionId)}`)).session);
    await open.context.loadHistory();
    open.context.render();
    open.view.render();
    open.rail.refresh();
  } catch {
    // The next action shows the failure.
  }
}

function renderHead() {
  const { session } = state.open;
  $("session-title").textContent = session.title || "(untitled)";
  $("session-kind").textContent = session.kind.replace("SESSION_KIND_", "").toLowerCase();
  const sources = state.merges.get(session.sessionId);
  $("provenance").hidden = !sources;
  if (sources) $("provenance").textContent = `Merged from ${sources.sourceSessionIds.map(titleOf).join(", ")} (primary: ${titleOf(sources.primarySessionId)}).`;
  $("send").disabled = !state.capabilities.includes("agent-v1");
  $("composer-text").placeholder = state.capabilities.includes("agent-v1")
    ? "Ask the agent… (Enter sends, Shift+Enter for a new line)"
    : "This gateway runs no agent (no agent-v1): the conversation is read-only here.";
}

function renderRunState() {
  const open = state.open;
  if (!open) return;
  const { running, source, runId, outcome } = runState(open);
  open.context.running = running;
  const connected = open.connection === "live";
  let text = running ? "Agent is running" : "Idle";
  if (source === "runtime" && !running && outcome) text += ` (last turn ${outcome})`;
  // A lost connection says nothing about the turn: it goes on (or ends) on the server.
  if (!connected && open.store.cursor) text += " (as last seen; the connection is down, the turn is not affected)";
  const element = $("run-state");
  element.textContent = text;
  element.title = runId ? `Run ${runId}` : source === "inferred" ? "The runtime publishes no state: inferred from the transcript" : "";
  element.dataset.running = String(running);
  element.dataset.source = source;
  element.dataset.runId = runId;
  $("stop").hidden = !running;
  // The context tab only changes with the run state (not with every streamed chunk).
  if (open.wasRunning !== running) {
    open.wasRunning = running;
    open.context.render();
  }
}

/**
 * Whether a turn runs. The runtime state the agent publishes decides (RUNNING with its run id, IDLE when
 * the turn ended), except that a turn this page started counts as running until the batch with its
 * user message (which carries RUNNING) has arrived. A runtime that publishes no state leaves the state
 * UNSPECIFIED; then it is inferred: an attempt streaming, or a turn this page started whose answer (an
 * assistant message without tool calls, or an interrupted one) has not arrived yet.
 */
function runState(open) {
  const published = open.store.runtimeState || {};
  const details = published.details || {};
  const seen = (id) => [...open.store.messages.keys()].some((known) => known >= id);
  if (published.state === "RUN_STATE_RUNNING" || published.state === "RUN_STATE_WAITING") {
    return { running: true, source: "runtime", runId: published.runId || "", outcome: "" };
  }
  if (published.state === "RUN_STATE_IDLE") {
    if (open.startedTurn && !seen(open.startedTurn)) return { running: true, source: "runtime", runId: "", outcome: "" };
    open.startedTurn = 0;
    return { running: false, source: "runtime", runId: "", outcome: details.outcome || "" };
  }
  if (open.store.prefixes.size > 0) return { running: true, source: "inferred", runId: "", outcome: "" };
  if (open.startedTurn) {
    const ended = [...open.store.messages.values()].some((m) =>
      Number(m.messageId) > open.startedTurn && m.role === "MESSAGE_ROLE_ASSISTANT" &&
      (!(m.toolCalls || []).length || m.status === "MESSAGE_STATUS_INTERRUPTED"));
    if (!ended) return { running: true, source: "inferred", runId: "", outcome: "" };
    open.startedTurn = 0;
  }
  return { running: false, source: "inferred", runId: "", outcome: "" };
}

async function locate(id) {
  $("locate-error").textContent = "";
  try {
    const found = await state.open.view.locate(id);
    if (found === false) return;
  } catch (error) {
    $("locate-error").textContent = explain(error);
  }
}

// Wiring

function wire() {
  $("sign-in-form").onsubmit = (event) => {
    event.preventDefault();
    signIn($("token").value.trim());
  };
  $("sign-out").onclick = () => {
    closeSession();
    storeToken("");
    showSignIn();
  };
  $("create-form").onsubmit = async (event) => {
    event.preventDefault();
    const title = $("new-title").value.trim() || "New session";
    try {
      const answer = await call("POST", "/v1/sessions", { body: { title } });
      $("new-title").value = "";
      await loadSessions();
      location.hash = `#/s/${encodeURIComponent(answer.session.sessionId)}`;
    } catch (error) {
      alert(explain(error));
    }
  };
  $("rename").onclick = async () => {
    const session = state.open.session;
    const title = prompt("New title", session.title);
    if (title === null) return;
    try {
      const answer = await call("PATCH", `/v1/sessions/${encodeURIComponent(session.sessionId)}`, { query: { updateMask: "title" }, body: { title } });
      setSession(answer.session);
    } catch (error) {
      alert(explain(error));
    }
  };
  $("delete").onclick = async () => {
    const session = state.open.session;
    if (!confirm(`Delete "${session.title || session.sessionId}" and every session under it?`)) return;
    try {
      await call("DELETE", `/v1/sessions/${encodeURIComponent(session.sessionId)}`);
      closeSession();
      history.replaceState(null, "", "#");
      $("session-view").hidden = true;
      $("empty-state").hidden = false;
      await loadSessions();
    } catch (error) {
      alert(explain(error));
    }
  };
  $("locate-form").onsubmit = (event) => {
    event.preventDefault();
    const id = Number($("locate-id").value);
    if (Number.isInteger(id) && id > 0) locate(id);
    else $("locate-error").textContent = "A message id is a positive whole number.";
  };
  const text = $("composer-text");
  text.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("composer").onsubmit = async (event) => {
    event.preventDefault();
    const open = state.open;
    if (!open || !text.value.trim()) return;
    $("send").disabled = true;
    $("composer-error").textContent = "";
    try {
      const started = await call("POST", `/v1/sessions/${encodeURIComponent(open.session.sessionId)}/turns`, {
        body: { text: text.value, clientRequestId: newId() },
      });
      open.startedTurn = Number(started.userMessageId);
      text.value = "";
      renderRunState();
      if (open.view.window) open.view.backToLive();
    } catch (error) {
      $("composer-error").textContent = explain(error);
    } finally {
      $("send").disabled = false;
    }
  };
  $("stop").onclick = async () => {
    const open = state.open;
    $("stop").disabled = true;
    try {
      await call("POST", `/v1/sessions/${encodeURIComponent(open.session.sessionId)}/turns:stop`);
      // Answered once the turn settled (or when none ran): either way no turn of ours is running now.
      open.startedTurn = 0;
      renderRunState();
    } catch (error) {
      $("composer-error").textContent = explain(error);
    } finally {
      $("stop").disabled = false;
    }
  };
  // Tabs: arrow keys move between them, as the ARIA tabs pattern says.
  const tabs = [$("tab-turns"), $("tab-context")];
  const select = (tab) => {
    for (const other of tabs) {
      const chosen = other === tab;
      other.setAttribute("aria-selected", String(chosen));
      other.tabIndex = chosen ? 0 : -1;
      $(other.getAttribute("aria-controls")).hidden = !chosen;
    }
    tab.focus();
  };
  tabs.forEach((tab, i) => {
    tab.onclick = () => select(tab);
    tab.onkeydown = (event) => {
      if (event.key === "ArrowRight" || event.key === "ArrowLeft") select(tabs[(i + (event.key === "ArrowRight" ? 1 : tabs.length - 1)) % tabs.length]);
    };
  });
  state.mergePanel = new MergePanel({
    sessions: () => state.sessions,
    openSession: (id) => loadSessions().then(() => { location.hash = `#/s/${encodeURIComponent(id)}`; }),
    onFinished: () => loadSessions(),
  });
  $("open-merge").onclick = () => state.mergePanel.open();
  window.addEventListener("hashchange", () => {
    const id = decodeURIComponent(location.hash.replace(/^#\/s\//, ""));
    if (id && id !== location.hash && (!state.open || state.open.session.sessionId !== id)) openSession(id);
  });
}

async function recoverMerge() {
  // An unfinished merge (started before a reload, or in another tab) reopens its panel.
  try {
    const answer = await call("GET", "/v1/session-merges:active");
    if (answer) state.mergePanel.open();
  } catch {
    // The panel shows errors when opened.
  }
}

wire();
if (storedToken()) signIn(storedToken());
else showSignIn();
