// The gateway's HTTP API as the console uses it: a bearer token, proto JSON bodies, AIP-193 errors.

const TOKEN_KEY = "continuum.token";

/** A refused or failed request: HTTP status, the ErrorInfo reason, the message and the details. */
export class ApiError extends Error {
  constructor(status, reason, message, details = []) {
    super(message);
    this.status = status;
    this.reason = reason;
    this.details = details;
  }

  /** The first detail of a proto type (e.g. a MergeOperation relayed with a merge refusal). */
  detail(typeSuffix) {
    return this.details.find((d) => String(d["@type"] || "").endsWith(typeSuffix));
  }
}

// The token lives in sessionStorage (this tab only); a browser that refuses storage keeps it in memory.
let memoryToken = "";

export function storedToken() {
  try {
    return sessionStorage.getItem(TOKEN_KEY) || memoryToken;
  } catch {
    return memoryToken;
  }
}

export function storeToken(token) {
  memoryToken = token;
  try {
    if (token) sessionStorage.setItem(TOKEN_KEY, token);
    else sessionStorage.removeItem(TOKEN_KEY);
  } catch {
    // Storage disabled (private mode, policy): the token stays in memory for this page.
  }
}

/** Read a small preference from localStorage; any storage failure is just "not set". */
export function preference(key, fallback) {
  try {
    const value = localStorage.getItem(key);
    return value === null ? fallback : JSON.parse(value);
  } catch {
    return fallback;
  }
}

export function setPreference(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
  } catch {
    // A preference that cannot be kept is forgotten at reload; nothing else depends on it.
  }
}

/** A random id for idempotency keys and client request ids. */
export function newId() {
  return crypto.randomUUID().replaceAll("-", "");
}

async function errorOf(response) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    // Not JSON: a proxy's page or an empty body.
  }
  const error = body && body.error ? body.error : {};
  const details = Array.isArray(error.details) ? error.details : [];
  const info = details.find((d) => String(d["@type"] || "").endsWith("google.rpc.ErrorInfo"));
  const reason = info ? info.reason : error.status || `HTTP_${response.status}`;
  return new ApiError(response.status, reason, error.message || response.statusText, details);
}

/**
 * Call the API. `body` is sent as JSON; `query` becomes the query string. Answers the parsed JSON
 * (null for 204). Throws ApiError for any non-2xx answer and for a network failure (status 0).
 */
export async function call(method, path, { body, query, headers = {}, signal } = {}) {
  const url = new URL(path, location.origin);
  for (const [key, value] of Object.entries(query || {})) {
    if (value !== undefined && value !== null && value !== "") url.searchParams.set(key, String(value));
  }
  const init = { method, headers: { Authorization: `Bearer ${storedToken()}`, ...headers }, signal };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(url, init);
  } catch (failure) {
    if (failure.name === "AbortError") throw failure;
    throw new ApiError(0, "NETWORK", "the gateway cannot be reached");
  }
  if (!response.ok) throw await errorOf(response);
  if (response.status === 204) return null;
  return response.json();
}

/** The browser's WebSocket subprotocol carrying the token (base64url, unpadded). */
export function bearerSubprotocol(token) {
  const bytes = new TextEncoder().encode(token);
  let binary = "";
  for (const byte of bytes) binary += String.fromCharCode(byte);
  return "continuum.bearer." + btoa(binary).replaceAll("+", "-").replaceAll("/", "_").replace(/=+$/, "");
}

/** Explanations of the refusals a person meets in the console, by ErrorInfo reason. */
const EXPLANATIONS = {
  MESSAGE_ALREADY_COMPACTED:
    "This message is already covered by the session's summary (it was compacted), so it can no longer be " +
    "edited: the model now sees the summary instead of it. Send a new message instead.",
  COMPACTION_FENCE_MOVED: "The session was compacted while you were editing; reload the message and try again.",
  HISTORY_GENERATION_MISMATCH: "The history changed meanwhile (another edit); the view is refreshed, try again.",
  SESSION_ALREADY_RUNNING: "The session is busy: a turn, a merge or a compaction holds it right now.",
  SESSION_BUSY: "The session is busy: a turn, a merge or a compaction holds it right now.",
  MERGE_ACTIVE_EXISTS: "You already have an unfinished merge; it is shown below.",
  MERGE_SOURCE_BUSY: "One of the sessions is busy (a turn or a compaction is running); try again when it is idle.",
  MERGE_STALE_OPERATION: "The merge moved on since you looked (another tab or a retry); it is refreshed below.",
  UNAUTHENTICATED: "The token is not valid for this gateway.",
  NETWORK: "The gateway cannot be reached.",
};

export function explain(error) {
  if (!(error instanceof ApiError)) return String(error && error.message ? error.message : error);
  const known = EXPLANATIONS[error.reason];
  return known ? `${known} (${error.reason})` : `${error.message} (${error.reason})`;
}
