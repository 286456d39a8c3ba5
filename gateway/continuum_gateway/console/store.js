// The record store a follower keeps (seed 003's client): committed messages keyed by message id, tool
// calls by call id, active sampling prefixes, runtime state and recent runtime events. Pure state, no
// I/O. `apply(frame)` takes the Follow frames of one stream in order and answers "applied", "ignored"
// or {resync, resumable}. A baseline snapshot is collected and installed in one step at its end, so the
// view never shows half of one; a resume keeps the records and replaces every active prefix at once.
// This mirrors clients/continuum_follow/store.py, the Python client the tests exercise.

// Three pages of 32: what the view keeps of the newest history (older pages are read on demand).
export const MESSAGE_LIMIT = 96;
const EVENT_LIMIT = 200;

const STATUS_FRAMES = new Set(["heartbeat", "recoveryFailure", "recovered"]);
const SNAPSHOT_FRAMES = new Set(["snapshotBegin", "snapshotRecords", "snapshotRuntime", "snapshotPrefix", "snapshotEnd"]);

const num = (value) => Number(value || 0);

export class RecordStore {
  constructor(messageLimit = MESSAGE_LIMIT) {
    this.messageLimit = messageLimit;
    this.messages = new Map(); // message id -> Message (proto JSON)
    this.tools = new Map(); // tool call id -> {call, callMessageId, resultMessageId}
    this.prefixes = new Map(); // message key -> {attempt, nextChunkIndex, text}
    this.settlements = new Map(); // message id -> outcome
    this.runtimeState = { state: "RUN_STATE_UNSPECIFIED", runId: "" };
    this.prompts = new Map();
    this.events = [];
    this.eventCount = 0; // events ever applied (the list keeps the last EVENT_LIMIT)
    this.cursor = null; // {streamGeneration, seq}
    this.durableSeq = 0;
    this.hasOlder = false;
    this.history = null; // {streamGeneration, snapshotSequence, beforeMessageId}
    this.recoveryFailure = null;
    this.stream = null;
    this.onInstall = () => {};
  }

  get live() {
    return this.cursor !== null && this.stream !== null && this.stream.phase === "live";
  }

  orderedMessages() {
    return [...this.messages.keys()].sort((a, b) => a - b).map((id) => this.messages.get(id));
  }

  endStream() {
    this.stream = null;
  }

  apply(frame) {
    const kind = frame.type;
    const payload = frame[kind];
    const generation = num(frame.streamGeneration);
    if (kind === "handshake") return this.#handshake(generation, payload);
    if (!this.stream) return this.#fail("out_of_order");
    if (kind === "resync") {
      this.stream = null;
      return { resync: String(payload.reason || "").replace("RESYNC_REASON_", "").toLowerCase(), resumable: !!payload.resumable };
    }
    if (kind === "error" || kind === "unknown" || payload === undefined) return "ignored";
    if (generation !== this.stream.generation) return this.#fail("generation_changed");
    if (this.stream.phase === "baseline") {
      if (STATUS_FRAMES.has(kind)) return this.#statusDuringBaseline(kind, payload);
      return this.#snapshotPart(kind, payload, generation);
    }
    if (this.stream.phase === "resume_prefixes") {
      if (kind === "snapshotPrefix") return this.#collectPrefix(payload);
      // The prefixes that follow a RESUME handshake replace all active prefixes together.
      this.prefixes = new Map();
      this.#installPrefixes(this.stream.prefixes);
      this.stream.prefixes = [];
      this.stream.phase = "live";
    }
    if (SNAPSHOT_FRAMES.has(kind)) return this.#fail("out_of_order");
    return this.#suffix(kind, payload);
  }

  #handshake(generation, handshake) {
    if (handshake.mode === "FOLLOW_MODE_BASELINE") {
      this.stream = { generation, phase: "baseline", durableSeq: num(handshake.durableSeq), prefixes: [] };
      return "applied";
    }
    if (handshake.mode === "FOLLOW_MODE_RESUME") {
      if (!this.cursor || this.cursor.streamGeneration !== generation) return this.#fail("generation_changed");
      this.stream = { generation, phase: "resume_prefixes", durableSeq: num(handshake.durableSeq), prefixes: [] };
      this.durableSeq = Math.max(this.durableSeq, num(handshake.durableSeq));
      return "applied";
    }
    return this.#fail("out_of_order");
  }

  #snapshotPart(kind, payload, generation) {
    const stream = this.stream;
    if (kind === "snapshotBegin") {
      if (stream.begin) return this.#fail("out_of_order");
      stream.begin = payload;
      stream.durableSeq = Math.max(stream.durableSeq, num(payload.durableSeq));
      return "applied";
    }
    if (!stream.begin) return this.#fail("out_of_order");
    if (kind === "snapshotRecords" && !stream.records) stream.records = payload;
    else if (kind === "snapshotRuntime" && !stream.runtime) stream.runtime = payload;
    else if (kind === "snapshotPrefix") return this.#collectPrefix(payload);
    else if (kind === "snapshotEnd") return this.#endSnapshot(payload, generation);
    else return this.#fail("out_of_order");
    return "applied";
  }

  #endSnapshot(end, generation) {
    const { begin, records, runtime, prefixes, durableSeq } = this.stream;
    if (!records || !runtime || num(end.seq) !== num(begin.seq)) return this.#fail("out_of_order");
    // Install everything at once: records, runtime, prompts, prefixes.
    this.cursor = { streamGeneration: generation, seq: num(begin.seq) };
    this.hasOlder = !!records.hasOlder;
    this.history = records.history
      ? {
          streamGeneration: num(records.history.streamGeneration),
          snapshotSequence: num(records.history.snapshotSequence),
          beforeMessageId: num(records.history.beforeMessageId),
        }
      : null;
    this.messages = new Map();
    this.tools = new Map();
    this.settlements = new Map();
    for (const message of records.messages || []) this.#putMessage(message);
    this.runtimeState = runtime.runtimeState || { state: "RUN_STATE_UNSPECIFIED" };
    this.prompts = new Map((runtime.prompts || []).map((p) => [p.promptId, p]));
    this.prefixes = new Map();
    this.#installPrefixes(prefixes);
    this.durableSeq = durableSeq;
    this.recoveryFailure = null;
    this.stream = { generation, phase: "live", durableSeq, prefixes: [] };
    this.onInstall();
    return "applied";
  }

  #collectPrefix(piece) {
    const collected = this.stream.prefixes;
    if (num(piece.firstChunkIndex)) {
      const previous = collected[collected.length - 1];
      if (
        !previous ||
        previous.attempt.messageKey !== piece.attempt.messageKey ||
        previous.attempt.attempt !== piece.attempt.attempt ||
        num(previous.nextChunkIndex) !== num(piece.firstChunkIndex)
      ) {
        return this.#fail("chunk_gap");
      }
    }
    collected.push(piece);
    return "applied";
  }

  #statusDuringBaseline(kind, payload) {
    if (kind === "heartbeat" || kind === "recovered") {
      this.stream.durableSeq = Math.max(this.stream.durableSeq, num(payload.durableSeq));
    }
    return "applied";
  }

  #suffix(kind, payload) {
    switch (kind) {
      case "batch":
        return this.#batch(payload);
      case "watermark":
        return this.#advance(num(payload.baseSeq), num(payload.seq));
      case "attemptOpened":
        return this.#attemptOpened(payload);
      case "chunk":
        return this.#chunk(payload);
      case "settlement":
        return this.#settlement(payload);
      case "heartbeat":
        this.durableSeq = Math.max(this.durableSeq, num(payload.durableSeq));
        if (this.recoveryFailure && num(payload.durableSeq) >= num(payload.commitSeq)) this.recoveryFailure = null;
        return "applied";
      case "recoveryFailure":
        this.recoveryFailure = payload;
        return "applied";
      case "recovered":
        this.recoveryFailure = null;
        this.durableSeq = Math.max(this.durableSeq, num(payload.durableSeq));
        return "applied";
      default:
        return "ignored";
    }
  }

  #advance(baseSeq, seq) {
    if (seq <= this.cursor.seq) return "ignored";
    if (baseSeq !== this.cursor.seq) return this.#fail("chain_gap");
    this.cursor = { ...this.cursor, seq };
    return "applied";
  }

  #batch(batch) {
    const chained = this.#advance(num(batch.baseSeq), num(batch.seq));
    if (chained !== "applied") return chained;
    for (const message of batch.messages || []) this.#putMessage(message);
    if (batch.runtimeState) this.runtimeState = batch.runtimeState;
    for (const prompt of batch.promptsUpserted || []) this.prompts.set(prompt.promptId, prompt);
    for (const id of batch.promptsResolved || []) this.prompts.delete(id);
    for (const event of batch.events || []) {
      this.events.push(event);
      this.eventCount += 1;
      if (this.events.length > EVENT_LIMIT) this.events.shift();
    }
    if (batch.settles) this.#dropPrefix(batch.settles);
    return "applied";
  }

  #attemptOpened(ref) {
    const current = this.prefixes.get(ref.messageKey);
    if (current && current.attempt >= ref.attempt) return "ignored";
    // A higher attempt of an open key is a retry: its text starts over.
    this.prefixes.set(ref.messageKey, { attempt: ref.attempt, nextChunkIndex: 0, text: "", retried: !!current || ref.attempt > 1 });
    return "applied";
  }

  #chunk(chunk) {
    const current = this.prefixes.get(chunk.attempt.messageKey);
    if (!current || chunk.attempt.attempt > current.attempt) return this.#fail("unknown_attempt");
    if (chunk.attempt.attempt < current.attempt) return "ignored";
    const index = num(chunk.chunkIndex);
    if (index < current.nextChunkIndex) return "ignored";
    if (index > current.nextChunkIndex) return this.#fail("chunk_gap");
    current.nextChunkIndex += 1;
    current.text += chunk.text;
    return "applied";
  }

  #settlement(settlement) {
    const id = num(settlement.messageId);
    if (num(settlement.seq) > this.cursor.seq || !this.messages.has(id)) return this.#fail("invalid_settlement");
    this.settlements.set(id, settlement.outcome);
    this.durableSeq = Math.max(this.durableSeq, num(settlement.seq));
    this.#dropPrefix(settlement.attempt);
    return "applied";
  }

  #fail(reason) {
    // The rest of this stream cannot be trusted; the follower gets a fresh baseline.
    this.stream = null;
    return { resync: reason, resumable: false };
  }

  #putMessage(message) {
    const id = num(message.messageId);
    if (message.deleted) {
      this.messages.delete(id);
      return;
    }
    this.messages.set(id, message);
    if (this.messages.size > this.messageLimit) this.#evictOldest();
    for (const call of message.toolCalls || []) {
      const known = this.tools.get(call.toolCallId) || {};
      this.tools.set(call.toolCallId, { ...known, call, callMessageId: id });
    }
    if (message.role === "MESSAGE_ROLE_TOOL" && message.toolCallId) {
      const known = this.tools.get(message.toolCallId) || {};
      this.tools.set(message.toolCallId, { ...known, resultMessageId: id });
    }
  }

  #installPrefixes(pieces) {
    for (const piece of pieces) {
      const key = piece.attempt.messageKey;
      const current = this.prefixes.get(key);
      const text = num(piece.firstChunkIndex) && current ? current.text + piece.text : piece.text;
      this.prefixes.set(key, { attempt: piece.attempt.attempt, nextChunkIndex: num(piece.nextChunkIndex), text, retried: piece.attempt.attempt > 1 });
    }
  }

  #evictOldest() {
    // The oldest message stays reachable through history pages, which continue before the oldest kept.
    const oldest = Math.min(...this.messages.keys());
    const evicted = this.messages.get(oldest);
    this.messages.delete(oldest);
    for (const call of evicted.toolCalls || []) {
      if (this.tools.get(call.toolCallId)?.callMessageId === oldest) this.tools.delete(call.toolCallId);
    }
    if (evicted.role === "MESSAGE_ROLE_TOOL" && this.tools.get(evicted.toolCallId)?.resultMessageId === oldest) {
      this.tools.delete(evicted.toolCallId);
    }
    this.settlements.delete(oldest);
    this.hasOlder = true;
    this.history = { streamGeneration: this.cursor.streamGeneration, snapshotSequence: this.cursor.seq, beforeMessageId: Math.min(...this.messages.keys()) };
  }

  #dropPrefix(ref) {
    const current = this.prefixes.get(ref.messageKey);
    if (current && current.attempt === ref.attempt) this.prefixes.delete(ref.messageKey);
  }
}
