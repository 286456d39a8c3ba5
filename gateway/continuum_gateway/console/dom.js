// Small DOM helpers: elements are built with text nodes only (never parsed markup), so no message text
// can become markup.

/** `h("div", {class: "x", onclick: f}, child, "text", ...)` */
export function h(tag, attributes = {}, ...children) {
  const element = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on")) element.addEventListener(name.slice(2), value);
    else if (name === "class") element.className = value;
    else if (value === true) element.setAttribute(name, "");
    else element.setAttribute(name, String(value));
  }
  append(element, children);
  return element;
}

function append(element, children) {
  for (const child of children) {
    if (child === undefined || child === null || child === false) continue;
    if (Array.isArray(child)) append(element, child);
    else element.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

export function $(id) {
  return document.getElementById(id);
}

/** "12.3 KiB" */
export function bytes(count) {
  const n = Number(count);
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} KiB`;
  return `${(n / 1024 / 1024).toFixed(1)} MiB`;
}

export function shortTime(rfc3339) {
  if (!rfc3339) return "";
  const date = new Date(rfc3339);
  return Number.isNaN(date.getTime()) ? "" : date.toLocaleString();
}

/** The text of a message's content parts. */
export function messageText(message) {
  return (message.content || []).map((part) => (part.text !== undefined ? part.text : "")).join("");
}

/** Collapse whitespace and cut to `limit` characters. */
export function preview(text, limit = 120) {
  const flat = String(text || "").replace(/\s+/g, " ").trim();
  return flat.length > limit ? flat.slice(0, limit - 1) + "…" : flat;
}
