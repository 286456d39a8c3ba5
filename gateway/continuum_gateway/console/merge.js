// The merge panel (seed 000 §8, `merge-v2`): choose 2-5 idle root sessions and the primary, start,
// then watch the operation: stage, units completed of those known (no invented percentage), the
// sessions it holds, why it paused, resume or cancel at the run epoch seen, and open the target once
// it is available. The user's unfinished merge is found again after a reload or from another tab.

import { ApiError, call, explain, newId } from "./api.js";
import { $, h } from "./dom.js";

const POLL_MS = 1000;
const KEY_STORAGE = "continuum.merge.pending";
const TERMINAL = new Set(["MERGE_STATUS_COMPLETED", "MERGE_STATUS_CANCELLED", "MERGE_STATUS_FAILED"]);

export class MergePanel {
  constructor({ sessions, openSession, onFinished }) {
    this.sessions = sessions; // () => the user's sessions
    this.openSession = openSession;
    this.onFinished = onFinished;
    this.dialog = $("merge-dialog");
    this.body = $("merge-body");
    this.operation = null;
    this.timer = null;
    this.error = "";
    $("merge-close").onclick = () => this.close();
    this.dialog.addEventListener("close", () => clearTimeout(this.timer));
  }

  async open() {
    this.error = "";
    if (!this.dialog.open) this.dialog.showModal();
    await this.recover();
  }

  close() {
    clearTimeout(this.timer);
    this.dialog.close();
  }

  /** The user's unfinished merge, if any (another tab may have started it). */
  async recover() {
    try {
      const answer = await call("GET", "/v1/session-merges:active");
      this.operation = answer ? answer.operation : this.#finishedOperation();
    } catch (error) {
      this.error = explain(error);
    }
    this.render();
    this.#schedule();
  }

  #finishedOperation() {
    // A merge that finished while the page was away: keep showing it until the dialog closes.
    return this.operation && this.dialog.open ? this.operation : null;
  }

  #schedule() {
    clearTimeout(this.timer);
    if (!this.dialog.open) return;
    this.timer = setTimeout(() => this.#poll(), POLL_MS);
  }

  async #poll() {
    // Redraw only when something changed: the chooser keeps what the person ticked and typed.
    let changed = false;
    try {
      const progress = this.operation?.progress;
      if (progress && !TERMINAL.has(progress.status)) {
        this.operation = (await call("GET", `/v1/session-merges/${encodeURIComponent(progress.operationId)}`)).operation;
        if (TERMINAL.has(this.operation.progress.status)) this.onFinished();
        changed = true;
      } else {
        // Another tab may start one meanwhile.
        const answer = await call("GET", "/v1/session-merges:active");
        if (answer) {
          this.operation = answer.operation;
          changed = true;
        }
      }
      if (this.error) {
        this.error = "";
        changed = true;
      }
    } catch (error) {
      this.error = explain(error);
      changed = true;
    }
    if (changed) this.render();
    this.#schedule();
  }

  render() {
    const parts = [];
    if (this.error) parts.push(h("p", { class: "error", role: "alert" }, this.error));
    const progress = this.operation?.progress;
    if (progress && !TERMINAL.has(progress.status)) parts.push(this.#progress());
    else {
      if (progress) parts.push(this.#progress());
      parts.push(this.#chooser());
    }
    this.body.replaceChildren(...parts);
  }

  #chooser() {
    const roots = this.sessions().filter((s) => !s.parentSessionId);
    const form = h("form", { id: "merge-form" });
    const rows = roots.map((session) =>
      h("tr", {},
        h("td", {}, h("input", { type: "checkbox", name: "source", value: session.sessionId, id: `src-${session.sessionId}`, "aria-label": `Merge ${session.title || session.sessionId}` })),
        h("td", {}, h("input", { type: "radio", name: "primary", value: session.sessionId, "aria-label": `${session.title || session.sessionId} is the primary` })),
        h("td", {}, h("label", { for: `src-${session.sessionId}` }, session.title || session.sessionId))));
    const title = h("input", { id: "merge-title-input", name: "title", maxlength: 200, placeholder: "Title of the merged session (optional)" });
    const status = h("p", { class: "error", role: "alert" });
    form.append(
      h("p", { class: "note" }, "Choose 2 to 5 idle sessions and the primary one (its goal leads). Sessions stay untouched; a new merged session is created."),
      h("table", { class: "choose" }, h("thead", {}, h("tr", {}, h("th", {}, "Merge"), h("th", {}, "Primary"), h("th", {}, "Session"))), h("tbody", {}, rows)),
      h("label", { for: "merge-title-input" }, "Title"), title,
      h("div", {}, h("button", { type: "submit", id: "start-merge" }, "Start merge")), status);
    form.onsubmit = async (event) => {
      event.preventDefault();
      status.textContent = "";
      const sources = [...form.querySelectorAll("input[name=source]:checked")].map((i) => i.value);
      const primary = form.querySelector("input[name=primary]:checked")?.value;
      if (sources.length < 2 || sources.length > 5) {
        status.textContent = "Choose between 2 and 5 sessions.";
        return;
      }
      if (!primary || !sources.includes(primary)) {
        status.textContent = "Choose the primary among the sessions being merged.";
        return;
      }
      await this.#start({ sourceSessionIds: sources, primarySessionId: primary, title: title.value.trim() }, status);
    };
    return form;
  }

  async #start(parameters, status) {
    // One idempotency key per intent: a retry after a lost answer starts nothing twice.
    const signature = JSON.stringify(parameters);
    let pending = null;
    try {
      pending = JSON.parse(sessionStorage.getItem(KEY_STORAGE) || "null");
    } catch {
      pending = null;
    }
    const key = pending && pending.signature === signature ? pending.key : newId();
    try {
      sessionStorage.setItem(KEY_STORAGE, JSON.stringify({ signature, key }));
    } catch {
      // Without storage a reload mints a new key; the server still allows one unfinished merge.
    }
    try {
      const answer = await call("POST", "/v1/session-merges", { body: { ...parameters, idempotencyKey: key } });
      this.operation = answer.operation;
      try {
        sessionStorage.removeItem(KEY_STORAGE);
      } catch {
        // See above.
      }
    } catch (error) {
      const relayed = error instanceof ApiError ? error.detail("continuum.merge.v1.MergeOperation") : null;
      if (relayed) this.operation = relayed;
      status.textContent = explain(error);
      if (!relayed) return;
    }
    this.render();
    this.#schedule();
  }

  #progress() {
    const { progress, parameters } = this.operation;
    const units = progress.progress || {};
    const known = units.knownUnits || 0;
    const unitText = known
      ? `${units.completedUnits || 0} of ${known} units done${units.totalFinal ? "" : " (more may be found)"}`
      : "Units not known yet";
    const rows = [
      ["Status", label(progress.status, "MERGE_STATUS_")],
      ["Stage", label(progress.stage, "MERGE_STAGE_")],
      ["Progress", unitText],
      ["Run epoch", progress.runEpoch],
      ["Sessions held", (progress.lockedSourceSessionIds || []).map((id) => this.#title(id)).join(", ") || "none"],
      ["Sources", (parameters.sourceSessionIds || []).map((id) => this.#title(id) + (id === parameters.primarySessionId ? " (primary)" : "")).join(", ")],
    ];
    if (progress.errorCode && progress.errorCode !== "MERGE_ERROR_CODE_UNSPECIFIED") {
      rows.push([progress.status === "MERGE_STATUS_PAUSED" ? "Paused because" : "Error", `${label(progress.errorCode, "MERGE_ERROR_CODE_")}${progress.error ? `: ${progress.error}` : ""}`]);
    }
    if (progress.retryTime) rows.push(["Next retry", new Date(progress.retryTime).toLocaleTimeString()]);
    const actions = h("div", { class: "merge-actions" });
    if (progress.canResume) actions.append(h("button", { type: "button", id: "resume-merge", onclick: () => this.#act("resume", { expectedEpoch: progress.runEpoch }) }, `Resume (epoch ${progress.runEpoch})`));
    if (progress.canCancel) actions.append(h("button", { type: "button", class: "danger", id: "cancel-merge", onclick: () => this.#act("cancel") }, "Cancel merge"));
    if (progress.targetAvailable) {
      actions.append(h("button", { type: "button", id: "open-target", onclick: () => { this.close(); this.openSession(progress.targetSessionId); } }, "Open the merged session"));
    }
    const busy = !TERMINAL.has(progress.status) && progress.status !== "MERGE_STATUS_PAUSED";
    return h("section", { class: "merge-progress", "aria-live": "polite", "aria-busy": busy ? "true" : "false" },
      h("h3", {}, parameters.title || "Merge"),
      h("dl", {}, rows.map(([k, v]) => [h("dt", {}, k), h("dd", {}, String(v))])),
      actions);
  }

  #title(id) {
    const session = this.sessions().find((s) => s.sessionId === id);
    return session && session.title ? session.title : id;
  }

  async #act(verb, body) {
    const id = encodeURIComponent(this.operation.progress.operationId);
    try {
      this.operation = (await call("POST", `/v1/session-merges/${id}:${verb}`, { body })).operation;
      this.error = "";
    } catch (error) {
      const relayed = error instanceof ApiError ? error.detail("continuum.merge.v1.MergeOperation") : null;
      if (relayed) this.operation = relayed;
      this.error = explain(error);
    }
    this.render();
    this.#schedule();
  }
}

function label(value, prefix) {
  const text = String(value || "").replace(prefix, "").toLowerCase().replaceAll("_", " ");
  return text.charAt(0).toUpperCase() + text.slice(1);
}
