// A conversation's replay items (GET /v1/conversations/{id}/items), grouped by the turn that
// committed them. An item stored without an id is listed with a view-only id that names its
// place, msg_<conversation hex><revision: 8 hex><index: 4 hex>, and a turn's input items come
// first: an item belongs to the turn of the latest such id before it. (A turn whose items
// all carry ids of their own is not told apart from the one before it; it says so.)

import { call, convId, path } from "./api.js";

const PAGE = 100;

export function viewRevision(id, hex) {
  if (typeof id !== "string" || id.length !== 48 || !id.startsWith(`msg_${hex}`)) return null;
  const revision = Number.parseInt(id.slice(36, 44), 16);
  return Number.isInteger(revision) ? revision : null;
}

export function responseId(uuid, revision) {
  return `resp_${uuid.replaceAll("-", "")}${revision.toString(16).padStart(8, "0")}`;
}

// The items of turns from..to (a Map revision -> items), newest pages first until the
// turn `from` is covered. Sealed content is asked for so that its size can be shown.
export async function itemsByTurn(uuid, from, to, signal) {
  const conversation = convId(uuid);
  const hex = conversation.slice(5);
  const newestFirst = [];
  let after = null;
  for (;;) {
    const query = new URLSearchParams({ order: "desc", limit: String(PAGE) });
    query.append("include[]", "reasoning.encrypted_content");
    if (after) query.set("after", after);
    const response = await call("GET", `/v1/conversations/${path(conversation)}/items?${query}`, {
      signal,
    });
    const page = await response.json();
    newestFirst.push(...page.data);
    const oldest = Math.min(...page.data.map((item) => viewRevision(item.id, hex) ?? Infinity));
    if (!page.has_more || !page.data.length || oldest < from) break;
    after = page.last_id;
  }
  const turns = new Map();
  let revision = null;
  for (const item of newestFirst.reverse()) {
    revision = viewRevision(item.id, hex) ?? revision;
    if (revision === null || revision < from || revision > to) continue;
    if (!turns.has(revision)) turns.set(revision, []);
    turns.get(revision).push(item);
  }
  return turns;
}

const encoder = new TextEncoder();

export function size(value) {
  return encoder.encode(typeof value === "string" ? value : JSON.stringify(value)).length;
}

// What an item says, in one line; sealed content only as its size, never decoded.
export function describe(item) {
  if (typeof item.encrypted_content === "string") {
    const summary = (item.summary || []).map((part) => part.text).join(" ");
    return { sealed: size(item.encrypted_content), text: summary };
  }
  if (item.type === "compaction") return { sealed: 0, text: "" };
  if (item.type === "message") return { text: textOf(item.content) };
  if (item.type === "function_call") return { text: `${item.name}(${item.arguments})` };
  if (item.type === "function_call_output") {
    return { text: typeof item.output === "string" ? item.output : JSON.stringify(item.output) };
  }
  return { text: "" };
}

function textOf(content) {
  if (typeof content === "string") return content;
  return (content || [])
    .map((part) => {
      if (typeof part.text === "string") return part.text;
      if (part.type === "input_image") return "[image]";
      if (part.type === "input_file") return `[file ${part.filename || ""}]`.replace(" ]", "]");
      return `[${part.type}]`;
    })
    .join(" ");
}
