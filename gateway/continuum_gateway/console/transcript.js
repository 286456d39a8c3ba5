// The natural-flow transcript of one session (seed 003's client view): the live tail from the record
// store, or, while the reader is in older history, a window of at most three adjacent pages of 32 read
// from the server, with live output held back until they return. Elements are keyed by message id
// (tool results by call id through their message) and reused, so live updates never rebuild the view.

import { call, explain } from "./api.js";
import { $, bytes, h, messageText, preview } from "./dom.js";

export const PAGE_SIZE = 32;
export const MAX_PAGES = 3;
// A tool result longer than this is folded; "Show all" reveals the rest of what was stored.
const FOLD_CHARS = 4000;

const num = (value) => Number(value || 0);

export class TranscriptView {
  constructor(session, store, { onEdited, onLoadedChange }) {
    this.session = session;
    this.store = store;
    this.onEdited = onEdited;
    this.onLoadedChange = onLoadedChange;
    this.container = $("transcript");
    this.window = null; // null: live tail; else {pages: [[message...]], hasOlder, hasNewer}
    this.elements = new Map(); // render key -> element
    this.markers = new Map(); // boundary message id -> trigger mode
    this.bodies = new Map(); // message id -> loaded full message (for deferred bodies)
    this.locateToken = 0;
    this.heldBack = 0;
    this.autoPage = true;
    this.container.replaceChildren();
    this.container.addEventListener("scroll", () => this.#maybePage());
    $("back-to-live").onclick = () => this.backToLive();
  }

  /** The ids currently shown (for the turn rail's "loaded" marks). */
  loadedIds() {
    return new Set(this.#messages().map((m) => num(m.messageId)));
  }

  addMarker(boundary, triggerMode) {
    this.markers.set(num(boundary), triggerMode);
  }

  #messages() {
    return this.window ? this.window.pages.flat() : this.store.orderedMessages();
  }

  /** Redraw from the store (or the history window); `live` frames while reading history only count. */
  render(kind = "") {
    if (this.window && kind && kind !== "install") {
      if (kind === "batch") this.heldBack += 1;
      this.#banner();
      return;
    }
    const stick = this.#atBottom();
    const messages = this.#messages();
    const wanted = [];
    const hasOlder = this.window ? this.window.hasOlder : this.store.hasOlder;
    if (hasOlder) wanted.push(["older", () => h("button", { type: "button", class: "pager", onclick: () => this.loadOlder() }, "Load older messages")]);
    else if (messages.length) wanted.push(["start", () => h("p", { class: "note start" }, "Start of the conversation")]);
    const boundaries = [...this.markers.keys()].sort((a, b) => a - b);
    let previousId = 0;
    for (const message of messages) {
      const id = num(message.messageId);
      for (const boundary of boundaries) {
        if (boundary >= previousId && boundary < id && previousId) {
          wanted.push([`marker:${boundary}`, () => this.#marker(boundary)]);
        }
      }
      previousId = id;
      wanted.push([`m:${id}:${message.status}:${this.bodies.has(id)}:${this.session.compactionFenceMessageId}`, () => this.#message(message), message]);
    }
    if (this.window) {
      if (this.window.hasNewer) wanted.push(["newer", () => h("button", { type: "button", class: "pager", onclick: () => this.loadNewer() }, "Load newer messages")]);
    } else {
      for (const [key, prefix] of this.store.prefixes) {
        wanted.push([`p:${key}:${prefix.attempt}`, () => this.#prefixElement(prefix)]);
      }
    }
    this.#reconcile(wanted);
    if (!this.window) {
      for (const [key, prefix] of this.store.prefixes) {
        const element = this.elements.get(`p:${key}:${prefix.attempt}`);
        if (element) element.querySelector(".text").textContent = prefix.text;
      }
    }
    this.#banner();
    if (stick && !this.window) this.container.scrollTop = this.container.scrollHeight;
    this.onLoadedChange();
  }

  #reconcile(wanted) {
    const next = new Map();
    const nodes = [];
    for (const [key, build, source] of wanted) {
      // A message element is reused only for the very record it was built from: a new baseline (an
      // edit's rewrite) brings new records, whose elements are built afresh in the same frame.
      const known = this.elements.get(key);
      const element = known && known.source === source ? known : build();
      element.source = source;
      element.dataset.key = key;
      next.set(key, element);
      nodes.push(element);
    }
    // Move only what is out of place: reused elements keep their state (open details, focus).
    let cursor = this.container.firstChild;
    for (const node of nodes) {
      if (node === cursor) cursor = cursor.nextSibling;
      else this.container.insertBefore(node, cursor);
    }
    while (cursor) {
      const after = cursor.nextSibling;
      cursor.remove();
      cursor = after;
    }
    this.elements = next;
  }

  #atBottom() {
    const c = this.container;
    return c.scrollHeight - c.scrollTop - c.clientHeight < 60;
  }

  #banner() {
    const banner = $("history-banner");
    banner.hidden = !this.window;
    if (this.window) {
      const held = this.heldBack ? ` ${this.heldBack} live update(s) held back.` : "";
      $("history-banner-text").textContent = `Reading older history: live output is paused here.${held}`;
    }
  }

  #marker(boundary) {
    const mode = this.markers.get(boundary);
    const label = mode === "TRIGGER_MODE_MANUAL" ? "Context compacted manually" : "Context compacted automatically";
    return h("div", { class: "marker", role: "separator", "aria-label": label },
      h("span", {}, `${label}: the model sees a summary of everything above (up to message ${boundary}).`));
  }

  #message(message) {
    const id = num(message.messageId);
    const full = this.bodies.get(id) || message;
    const role = message.role.replace("MESSAGE_ROLE_", "").toLowerCase();
    const fence = num(this.session.compactionFenceMessageId);
    const badges = [];
    if (message.status === "MESSAGE_STATUS_INTERRUPTED") badges.push(h("span", { class: "badge warn" }, "interrupted"));
    if (role === "user" && fence && id <= fence) badges.push(h("span", { class: "badge", title: "Covered by the session's summary" }, "compacted"));
    if (role === "tool" && truncated(full)) badges.push(h("span", { class: "badge warn", title: "The tool cut its own output short; the model saw only part of it" }, "output truncated"));
    const who = { user: "You", assistant: "Agent", tool: "Tool result", system: "System" }[role] || role;
    const header = h("div", { class: "who" }, h("span", {}, who), h("span", { class: "id" }, `#${id}`), badges);
    const article = h("article", { class: `message ${role}`, id: `message-${id}`, tabindex: "-1", "aria-label": `${who}, message ${id}` }, header);
    if (message.bodyDeferred && !this.bodies.has(id)) {
      article.append(h("p", { class: "text" }, message.preview || "(no preview)"),
        h("button", { type: "button", class: "quiet", onclick: () => this.#loadBody(id) }, `Load the full message (${bytes(message.bodyBytes)})`));
    } else if (role === "tool") {
      article.append(this.#toolResult(full));
    } else {
      article.append(h("p", { class: "text" }, messageText(full)));
    }
    for (const toolCall of message.toolCalls || []) {
      article.append(h("div", { class: "tool-call" }, h("span", { class: "tool-name" }, toolCall.name), h("code", {}, preview(toolCall.arguments, 200))));
    }
    if (role === "user" && !this.window?.readOnly) {
      article.append(h("button", { type: "button", class: "quiet edit", onclick: () => this.#edit(article, full) }, "Edit"));
    }
    return article;
  }

  #toolResult(message) {
    const text = messageText(message);
    const call = this.store.tools.get(message.toolCallId)?.call ||
      this.#messages().flatMap((m) => m.toolCalls || []).find((c) => c.toolCallId === message.toolCallId);
    const name = call ? call.name : message.toolCallId;
    const body = h("pre", { class: "tool-output" }, text.length > FOLD_CHARS ? text.slice(0, FOLD_CHARS) + "…" : text);
    const details = h("details", {}, h("summary", {}, `${name} · ${bytes(new TextEncoder().encode(text).length)}`), body);
    if (text.length > FOLD_CHARS) {
      details.append(h("button", { type: "button", class: "quiet", onclick: (e) => { body.textContent = text; e.target.remove(); } }, "Show all"));
    }
    return details;
  }

  #prefixElement(prefix) {
    const label = prefix.attempt > 1 ? `Agent · retrying (attempt ${prefix.attempt})` : "Agent · writing…";
    return h("article", { class: "message assistant streaming", "aria-busy": "true" },
      h("div", { class: "who" }, h("span", {}, label)), h("p", { class: "text" }, prefix.text));
  }

  async #loadBody(id) {
    try {
      const answer = await call("GET", `/v1/sessions/${encodeURIComponent(this.session.sessionId)}/messages/${id}`);
      this.bodies.set(id, answer.message);
      this.render();
    } catch (error) {
      this.elements.forEach((el) => el.id === `message-${id}` && el.append(h("p", { class: "error" }, explain(error))));
    }
  }

  #edit(article, message) {
    if (article.querySelector("form")) return;
    const area = h("textarea", { rows: 3, "aria-label": "New text of the message" });
    area.value = messageText(message);
    const error = h("p", { class: "error", role: "alert" });
    const form = h("form", { class: "edit-form" }, area,
      h("div", {}, h("button", { type: "submit" }, "Save and rerun from here"), " ",
        h("button", { type: "button", class: "quiet", onclick: () => form.remove() }, "Cancel")),
      h("p", { class: "note" }, "Saving replaces this message and deletes every later message."), error);
    form.onsubmit = async (event) => {
      event.preventDefault();
      try {
        await call("POST", `/v1/sessions/${encodeURIComponent(this.session.sessionId)}/messages/${num(message.messageId)}:edit`, {
          body: { content: [{ text: area.value }], expectedHistoryGeneration: this.session.historyGeneration },
        });
        form.remove();
        this.onEdited();
      } catch (failure) {
        error.textContent = explain(failure);
        article.classList.add("refused");
      }
    };
    article.append(form);
    area.focus();
  }

  // Paging

  #pin() {
    const cursor = this.store.cursor;
    return cursor ? { streamGeneration: cursor.streamGeneration, snapshotSequence: cursor.seq } : {};
  }

  async #page(anchor, direction) {
    const path = `/v1/sessions/${encodeURIComponent(this.session.sessionId)}/messages:page`;
    const query = { anchor, direction, pageSize: PAGE_SIZE, ...this.#pin() };
    let answer = await call("GET", path, { query });
    if (answer.status === "PIN_STATUS_STALE") {
      // The pinned cut is gone (an edit or a rebind); the stream resyncs on its own. One unpinned retry
      // by the same message identity, never a reinterpretation of positions.
      answer = await call("GET", path, { query: { anchor, direction, pageSize: PAGE_SIZE } });
    }
    return answer;
  }

  async loadOlder() {
    const messages = this.#messages();
    if (!messages.length) return;
    const anchorElement = this.container.querySelector("article.message");
    const before = anchorElement ? anchorElement.getBoundingClientRect().top : 0;
    const windowBefore = this.window;
    const answer = await this.#page(num(messages[0].messageId), "older");
    // The reader moved on while the page loaded (back to live, a locate): this page is not wanted.
    if (this.window !== windowBefore) return;
    if (!this.window) {
      // Entering history: the live tail's pages become the window, and live output is held back.
      const pages = [];
      for (let i = messages.length; i > 0; i -= PAGE_SIZE) pages.unshift(messages.slice(Math.max(0, i - PAGE_SIZE), i));
      this.window = { pages, hasOlder: true, hasNewer: false };
      this.heldBack = 0;
    }
    this.window.pages.unshift(answer.messages || []);
    this.window.hasOlder = !!answer.hasOlder;
    while (this.window.pages.length > MAX_PAGES) {
      this.window.pages.pop();
      this.window.hasNewer = true;
    }
    this.render();
    if (anchorElement && anchorElement.isConnected) {
      this.container.scrollTop += anchorElement.getBoundingClientRect().top - before;
    }
  }

  async loadNewer() {
    if (!this.window) return;
    const messages = this.#messages();
    const last = messages[messages.length - 1];
    const windowBefore = this.window;
    const answer = await this.#page(last ? num(last.messageId) : 0, "newer");
    if (this.window !== windowBefore) return;
    if (!answer.hasNewer) {
      this.backToLive();
      return;
    }
    const anchorElement = [...this.container.querySelectorAll("article.message")].pop();
    const before = anchorElement ? anchorElement.getBoundingClientRect().top : 0;
    this.window.pages.push(answer.messages || []);
    while (this.window.pages.length > MAX_PAGES) {
      this.window.pages.shift();
      this.window.hasOlder = true;
    }
    this.window.hasNewer = true;
    this.render();
    if (anchorElement && anchorElement.isConnected) {
      this.container.scrollTop += anchorElement.getBoundingClientRect().top - before;
    }
  }

  backToLive() {
    this.window = null;
    this.heldBack = 0;
    this.render();
    this.container.scrollTop = this.container.scrollHeight;
  }

  #maybePage() {
    if (this.paging) return;
    const c = this.container;
    let job = null;
    if (c.scrollTop < 40 && (this.window ? this.window.hasOlder : this.store.hasOlder) && this.autoPage) job = () => this.loadOlder();
    if (!job) return;
    this.paging = true;
    job().catch(() => {}).finally(() => { this.paging = false; });
  }

  /**
   * Show message `id`: scroll to it when loaded, otherwise read the 32-message window starting at it.
   * A newer call cancels an older one still loading (the reader's latest click wins).
   */
  async locate(id) {
    const token = ++this.locateToken;
    if (!this.loadedIds().has(id)) {
      const answer = await this.#page(id - 1, "newer");
      if (token !== this.locateToken) return false;
      const page = answer.messages || [];
      if (!page.length || num(page[0].messageId) !== id) throw new Error(`message ${id} is not in this session's history`);
      if (this.store.messages.has(id)) this.window = null;
      else {
        this.window = { pages: [page], hasOlder: !!answer.hasOlder, hasNewer: true };
        this.heldBack = 0;
      }
      this.render();
    }
    if (token !== this.locateToken) return false;
    const element = $(`message-${id}`);
    if (!element) return false;
    element.scrollIntoView({ block: "center" });
    element.classList.add("located");
    setTimeout(() => element.classList.remove("located"), 2500);
    element.focus({ preventScroll: true });
    return true;
  }
}

function truncated(message) {
  if (message.resultTruncated) return true;
  // A tool that cut its output says so at the top of its JSON result (seed 004 §5.6).
  const text = messageText(message);
  if (!text.startsWith("{")) return false;
  try {
    return JSON.parse(text).truncated === true;
  } catch {
    return false;
  }
}
