// The turn rail over the durable outline (`history-outline-v1`): the whole conversation's turns, read
// in pages of 128 pinned to the first page's cut, at most six pages per session. Selecting a turn
// locates its first message, loaded or not.

import { call, explain } from "./api.js";
import { $, h, preview } from "./dom.js";

const OUTLINE_PAGE = 128;
const MAX_OUTLINE_PAGES = 6;
const num = (value) => Number(value || 0);

export class TurnRail {
  constructor(sessionId, { locate }) {
    this.sessionId = sessionId;
    this.locate = locate;
    this.entries = [];
    this.totalTurns = 0;
    this.loading = null;
    this.stale = false;
  }

  /** Read the outline again (after new turns or an edit); a read already running is reused. */
  refresh() {
    if (this.loading) {
      this.stale = true;
      return this.loading;
    }
    this.loading = this.#load().finally(() => {
      this.loading = null;
      if (this.stale) {
        this.stale = false;
        this.refresh();
      }
    });
    return this.loading;
  }

  async #load() {
    const entries = [];
    let pin = {};
    let startTurn = 1;
    let answer = null;
    let retried = false;
    try {
      for (let page = 0; page < MAX_OUTLINE_PAGES; page += 1) {
        answer = await call("GET", "/session-history/outline", {
          query: { sessionId: this.sessionId, startTurn, limit: OUTLINE_PAGE, ...pin },
          headers: { "X-Continuum-Capabilities": "history-outline-v1" },
        });
        if (answer.status === "unsupported") {
          $("outline-status").textContent = "This gateway has no turn outline; upgrade it to navigate every turn.";
          return;
        }
        if (answer.status === "stale") {
          // The cut is gone (an edit): start over once from a fresh first page.
          if (page > 0 && !retried) {
            retried = true;
            pin = {};
            entries.length = 0;
            startTurn = 1;
            continue;
          }
          break;
        }
        entries.push(...answer.entries);
        pin = { generation: answer.generation, snapshotSequence: answer.snapshotSequence };
        if (answer.done || !answer.nextTurn) break;
        startTurn = answer.nextTurn;
      }
    } catch (error) {
      $("outline-status").textContent = `The turn outline could not be read: ${explain(error)}`;
      return;
    }
    this.entries = entries;
    this.totalTurns = answer ? answer.totalTurns : entries.length;
    this.render(new Set());
  }

  /** Draw the rail; `loaded` are the message ids the transcript shows now. */
  render(loaded) {
    const rail = $("turn-rail");
    const shown = this.entries.length < this.totalTurns ? ` (the first ${this.entries.length} are listed)` : "";
    $("outline-status").textContent = this.totalTurns
      ? `${this.totalTurns} turn(s)${shown}. Highlighted turns are on screen; any other one loads when chosen.`
      : "No turns yet.";
    rail.replaceChildren(
      ...this.entries.map((entry) => {
        const id = num(entry.messageId);
        const counts = [];
        if (entry.elapsed) counts.push(`${parseFloat(entry.elapsed).toFixed(1)} s`);
        if (entry.samplingCount !== undefined) counts.push(`${entry.samplingCount} sampling`);
        if (entry.toolCallCount !== undefined) counts.push(`${entry.toolCallCount} tool call(s)`);
        const button = h("button", {
          type: "button",
          class: loaded.has(id) ? "turn loaded" : "turn",
          "data-message-id": id,
          "aria-current": loaded.has(id) ? "true" : null,
          onclick: () => this.locate(id),
        },
        h("span", { class: "turn-number" }, `${entry.turn}`),
        h("span", { class: "turn-prompt" }, preview(entry.prompt, 90) || "(empty prompt)"),
        counts.length ? h("span", { class: "turn-counts" }, counts.join(" · ")) : null);
        return h("li", {}, button);
      }),
    );
  }
}
