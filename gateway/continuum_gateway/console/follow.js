// One session's Follow WebSocket with reconnection. Frames go to a RecordStore; the connection state
// ("connecting", "live", "reconnecting", "offline", "refused") is reported separately: losing the
// connection says nothing about the turn, which goes on (or ends) on the server regardless.

import { bearerSubprotocol, storedToken } from "./api.js";

const PROTOCOL = "continuum.follow.v1";
const FIRST_DELAY_MS = 500;
const MAX_DELAY_MS = 8000;
// Close codes after which trying again cannot help (4000 + HTTP status: bad token, forbidden, gone, upgrade).
const FINAL_CLOSE_CODES = new Set([4401, 4403, 4404, 4426]);

export class FollowConnection {
  /**
   * `onChange(kind)` is called after every applied frame ("frame") and when a snapshot was installed
   * ("install"); `onState(state, detail)` when the connection state changes.
   */
  constructor(sessionId, store, { onChange, onState }) {
    this.sessionId = sessionId;
    this.store = store;
    this.onChange = onChange;
    this.onState = onState;
    this.socket = null;
    this.closed = false;
    this.failures = 0;
    this.timer = null;
    this.resumeNext = false;
    this.lastResync = "";
    this.resyncCount = 0;
  }

  start() {
    this.#open();
    // Coming back online retries at once instead of waiting out the backoff.
    this.onlineListener = () => {
      if (!this.socket && !this.closed) {
        clearTimeout(this.timer);
        this.#open();
      }
    };
    window.addEventListener("online", this.onlineListener);
  }

  close() {
    this.closed = true;
    clearTimeout(this.timer);
    window.removeEventListener("online", this.onlineListener);
    if (this.socket) this.socket.close(1000);
    this.socket = null;
    this.store.endStream();
  }

  #open() {
    if (this.closed) return;
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const url = `${scheme}//${location.host}/v1/sessions/${encodeURIComponent(this.sessionId)}/follow`;
    this.onState(this.failures ? "reconnecting" : "connecting", { attempt: this.failures });
    let socket;
    try {
      socket = new WebSocket(url, [PROTOCOL, bearerSubprotocol(storedToken())]);
    } catch {
      this.#retry();
      return;
    }
    this.socket = socket;
    let refused = null;
    socket.onopen = () => {
      const hello = { type: "hello", capabilities: ["transcript-v2"] };
      // Resume with the applied cursor after a drop or a resumable resync; the server answers a
      // cursor it can no longer continue with a fresh baseline, which the store installs whole.
      if (this.store.cursor) {
        hello.resume = { streamGeneration: String(this.store.cursor.streamGeneration), seq: String(this.store.cursor.seq) };
      }
      socket.send(JSON.stringify(hello));
    };
    socket.onmessage = (event) => {
      let frame;
      try {
        frame = JSON.parse(event.data);
      } catch {
        return;
      }
      if (frame.type === "error") {
        refused = frame.error;
        return;
      }
      const outcome = this.store.apply(frame);
      if (frame.type === "snapshotEnd" || (frame.type === "handshake" && frame.handshake.mode === "FOLLOW_MODE_RESUME")) {
        this.failures = 0;
        this.onState("live", {});
      }
      if (outcome && outcome.resync) {
        this.lastResync = outcome.resync;
        this.resyncCount += 1;
        // Keep showing what is installed (no flash): the next baseline replaces it in one step.
        if (!outcome.resumable) this.store.cursor = null;
        this.onState("resyncing", { reason: outcome.resync });
        socket.close(1000);
        return;
      }
      if (outcome === "applied") this.onChange(frame.type === "snapshotEnd" ? "install" : frame.type);
    };
    socket.onclose = (event) => {
      if (this.socket !== socket) return;
      this.socket = null;
      this.store.endStream();
      if (this.closed) return;
      if (FINAL_CLOSE_CODES.has(event.code)) {
        this.onState("refused", { code: event.code, error: refused });
        return;
      }
      if (this.lastResync && event.code === 1000) {
        // A resync ends the stream normally: follow again at once.
        this.lastResync = "";
        this.#open();
        return;
      }
      this.#retry();
    };
  }

  #retry() {
    this.failures += 1;
    const delay = Math.min(MAX_DELAY_MS, FIRST_DELAY_MS * 2 ** (this.failures - 1));
    this.onState(navigator.onLine === false ? "offline" : "reconnecting", { attempt: this.failures, delayMs: delay });
    this.timer = setTimeout(() => this.#open(), delay);
  }
}
