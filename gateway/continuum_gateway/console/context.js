// The Context tab (seed 004 §5.3): what the last model request was made of, the memory switch, compact
// now, and the last summary. Figures are the manifest's estimates (UTF-8 bytes / 4); tool definitions
// are not part of them.

import { call, explain } from "./api.js";
import { $, h, shortTime } from "./dom.js";

const num = (value) => Number(value || 0);
const MANIFEST_KEY = "continuum.manifest.";

export class ContextTab {
  constructor(session, store, { onSessionChanged, onMarker }) {
    this.session = session;
    this.store = store;
    this.onSessionChanged = onSessionChanged;
    this.onMarker = onMarker;
    this.panel = $("panel-context");
    this.manifest = this.#remembered();
    this.compactState = null; // {state, text}
    this.summary = undefined;
    this.events = [];
    this.seenEvents = 0;
  }

  #remembered() {
    try {
      return JSON.parse(sessionStorage.getItem(MANIFEST_KEY + this.session.sessionId) || "null");
    } catch {
      return null;
    }
  }

  /** Take the runtime events the store gathered since the last call. */
  absorb() {
    const events = this.store.events;
    const unseen = Math.min(events.length, this.store.eventCount - this.seenEvents);
    const fresh = unseen > 0 ? events.slice(events.length - unseen) : [];
    this.seenEvents = this.store.eventCount;
    let changed = false;
    for (const event of fresh) {
      if (event.contextWindow && event.contextWindow.manifest) {
        this.manifest = { ...event.contextWindow.manifest, at: new Date().toISOString() };
        try {
          sessionStorage.setItem(MANIFEST_KEY + this.session.sessionId, JSON.stringify(this.manifest));
        } catch {
          // Not kept across reloads; shown until then.
        }
        changed = true;
      }
      if (event.compactionStarted && this.compactState?.state === "COMPACT_NOW_STATE_QUEUED" && event.compactionStarted.triggerMode === "TRIGGER_MODE_MANUAL") {
        this.compactState = { state: "RUNNING", text: "Compacting now, at the running turn's tool-round boundary…" };
        changed = true;
      }
      if (event.compactionEnded) {
        if (event.compactionEnded.triggerMode === "TRIGGER_MODE_MANUAL") {
          this.compactState = { state: "DONE", text: `Compaction finished: ${outcome(event.compactionEnded.outcome)}.` };
        }
        this.summary = undefined;
        changed = true;
      }
      if (event.compactionMarker) this.onMarker(event.compactionMarker.boundary, event.compactionMarker.triggerMode);
    }
    if (changed) this.render();
  }

  async loadHistory() {
    try {
      const answer = await call("GET", `/v1/sessions/${this.#id()}/compaction/events`, { query: { pageSize: 20 } });
      this.events = answer.events || [];
      for (const event of this.events) {
        if (event.outcome === "COMPACTION_OUTCOME_COMPACTED") this.onMarker(event.boundaryAfter, event.triggerMode);
      }
    } catch {
      this.events = [];
    }
  }

  #id() {
    return encodeURIComponent(this.session.sessionId);
  }

  render() {
    const running = !!this.running;
    this.panel.replaceChildren(
      h("h3", {}, "Last model request"),
      this.#sections(),
      h("h3", {}, "Memory"),
      this.#memory(),
      h("h3", {}, "Compaction"),
      this.#compaction(running),
    );
  }

  #sections() {
    const manifest = this.manifest;
    if (!manifest) {
      return h("p", { class: "note" }, "No model request was built since this session was opened here. Send a message: the figures appear with the run.");
    }
    const window = num(manifest.effectiveWindowTokens);
    const total = num(manifest.estimatedTotalTokens);
    const rows = (manifest.sections || []).map((section) => {
      const tokens = num(section.estimatedTokens);
      const share = window ? Math.min(100, (tokens / window) * 100) : 0;
      const count = section.count ? ` · ${section.count}` : "";
      return h("li", { class: "section-row" },
        h("div", { class: "section-label" }, h("span", {}, section.label || section.key), h("span", {}, `≈${tokens.toLocaleString()} tokens${count}`)),
        h("div", { class: "bar", role: "meter", "aria-label": `${section.label || section.key}: about ${tokens} tokens of a ${window}-token window`, "aria-valuenow": tokens, "aria-valuemin": 0, "aria-valuemax": window || tokens },
          h("span", { style: null, "data-share": share.toFixed(1) })));
    });
    const list = h("ul", { class: "sections" }, rows);
    // Widths are set from script (the CSP allows no inline style attributes).
    queueMicrotask(() => list.querySelectorAll("[data-share]").forEach((bar) => { bar.style.width = `${bar.dataset.share}%`; }));
    const notes = [
      h("p", { class: "note" }, `Estimates (UTF-8 bytes / 4), ≈${total.toLocaleString()} of a ${window.toLocaleString()}-token window. `,
        "Tool definitions are not counted here, so the provider's own count of the request is higher; that gap is expected."),
    ];
    if (manifest.omittedMessageCount) notes.push(h("p", { class: "note warn" }, `${manifest.omittedMessageCount} older message(s) were left out of that request to stay within its size limit.`));
    if (manifest.clippedMessageCount) notes.push(h("p", { class: "note warn" }, `${manifest.clippedMessageCount} message(s) were clipped in that request.`));
    return h("div", {}, list, notes);
  }

  #memory() {
    const chips = this.#memoryChips();
    const toggle = h("input", { type: "checkbox", id: "memory-switch", role: "switch", checked: !this.session.memoryInjectionDisabled });
    const status = h("span", { class: "note", role: "status" }, this.memoryStatus || "");
    toggle.onchange = async () => {
      toggle.disabled = true;
      try {
        const answer = await call("PATCH", `/v1/sessions/${this.#id()}`, {
          query: { updateMask: "memoryInjectionDisabled" },
          body: { memoryInjectionDisabled: !toggle.checked },
        });
        this.session = answer.session;
        this.memoryStatus = toggle.checked ? "Memory injection is on." : "Memory injection is off.";
        this.onSessionChanged(answer.session);
      } catch (error) {
        this.memoryStatus = explain(error);
      }
      // Redrawn from the session as the server now has it.
      this.render();
    };
    return h("div", {}, chips,
      h("div", { class: "switch-row" }, toggle, h("label", { for: "memory-switch" }, "Inject memory into this session")),
      h("p", { class: "note" }, "Applies from the next run: a turn already running keeps what it started with."), status);
  }

  /**
   * The memory entries the last request carried. The manifest names them by id only (the reference agent's
   * ids are hashes of each entry's text in its memory file), so the chips show ids, with the count from
   * the manifest's memory section (which stays whole when a large manifest drops ids).
   */
  #memoryChips() {
    const manifest = this.manifest;
    if (!manifest) return h("p", { class: "note", id: "memory-entries" }, "No model request seen yet: memory entries show with the next run.");
    const ids = manifest.memoryIds || [];
    const section = (manifest.sections || []).find((s) => s.key === "memory");
    const count = section ? num(section.count) : ids.length;
    if (!count) {
      const why = this.session.memoryInjectionDisabled ? " Memory injection is off for this session." : "";
      return h("p", { class: "note", id: "memory-entries", "data-count": "0" }, `No memory entries were in the last request.${why}`);
    }
    const notes = [h("p", { class: "note", id: "memory-entries", "data-count": String(count) },
      `${count} memory ${count === 1 ? "entry was" : "entries were"} in the last request. `,
      "The request names entries by id only; the reference agent's ids are hashes of each entry's text in MEMORY.md of the working directory.")];
    if (ids.length < count) notes.push(h("p", { class: "note" }, `The ids of ${count - ids.length} of them were left out to keep the manifest small.`));
    return h("div", {}, ...notes,
      h("ul", { class: "chips", "aria-label": "Ids of the memory entries in the last request" },
        ids.map((id) => h("li", { class: "chip", title: `Memory entry ${id}` }, id))));
  }

  #compaction(running) {
    const button = h("button", { type: "button", id: "compact-now" }, "Compact now");
    const state = h("p", { class: "note", role: "status", id: "compact-state" }, this.compactState ? this.compactState.text : "");
    if (this.compactState?.state === "QUEUED_LOCAL" || this.compactState?.state === "COMPACT_NOW_STATE_QUEUED") button.disabled = true;
    button.onclick = async () => {
      button.disabled = true;
      this.compactState = { state: "QUEUED_LOCAL", text: "Asking…" };
      state.textContent = this.compactState.text;
      try {
        const answer = await call("POST", `/v1/sessions/${this.#id()}/compaction:compactNow`, { body: {} });
        if (answer.state === "COMPACT_NOW_STATE_QUEUED") {
          this.compactState = { state: answer.state, text: "Queued: it runs at the running turn's next tool-round boundary." };
        } else if (answer.state === "COMPACT_NOW_STATE_IN_PROGRESS") {
          this.compactState = { state: answer.state, text: "A compaction of this session is already in progress." };
        } else {
          this.compactState = { state: answer.state, text: `Done: ${outcome(answer.report?.outcome)}.` };
          this.summary = undefined;
          await this.loadHistory();
          this.onSessionChanged(null);
        }
      } catch (error) {
        this.compactState = { state: "FAILED", text: explain(error) };
      }
      this.render();
    };
    const details = h("details", { id: "last-summary" }, h("summary", {}, "Last summary"), h("p", { class: "note" }, "Loading…"));
    details.ontoggle = () => details.open && this.#fillSummary(details);
    const history = this.events.length
      ? h("ul", { class: "events" }, this.events.slice(0, 8).map((e) =>
          h("li", {}, `${shortTime(e.createTime)}: ${trigger(e.triggerMode)}, ${outcome(e.outcome)}`,
            e.outcome === "COMPACTION_OUTCOME_COMPACTED" ? ` (≈${num(e.estimatedTokensBefore)} → ≈${num(e.estimatedTokensAfter)} tokens)` : "")))
      : h("p", { class: "note" }, "No compaction yet.");
    return h("div", {}, h("p", { class: "note" }, running ? "A turn is running: compacting now waits for its next tool-round boundary." : "The session is idle: compacting now runs at once."),
      button, state, details, h("h4", {}, "Recent compactions"), history);
  }

  async #fillSummary(details) {
    let body;
    try {
      const answer = await call("GET", `/v1/sessions/${this.#id()}/compaction`);
      const summary = answer.data;
      body = summary
        ? [h("p", { class: "note" }, `Version ${summary.compactCount} · covers messages up to ${summary.lastCompactedMessageId} · model ${summary.model || "(unnamed)"} · updated ${shortTime(summary.updateTime)}`),
           h("pre", { class: "summary-text" }, summary.summaryText)]
        : [h("p", { class: "note" }, "This session has no summary yet.")];
    } catch (error) {
      body = [h("p", { class: "error" }, explain(error))];
    }
    details.replaceChildren(details.firstChild, ...body);
  }
}

function outcome(value) {
  return String(value || "unknown").replace("COMPACTION_OUTCOME_", "").toLowerCase().replaceAll("_", " ");
}

function trigger(value) {
  return { TRIGGER_MODE_MANUAL: "manual", TRIGGER_MODE_MID_LOOP: "during a turn", TRIGGER_MODE_REQUEST_START: "before a turn" }[value] || "unknown";
}
