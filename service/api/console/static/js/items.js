// The items of each turn a transcript page shows, by the /v1 Response the turn is (its
// `response_id`: ids are opaque, so a listing's ids say nothing of their turn): its input
// items, then its output (a compacting turn's compaction item first). Sealed content is asked
// for so that its size can be shown. A turn whose response was deleted has none to show.

import { call, path } from "./api.js";

const ENCRYPTED = "include[]=reasoning.encrypted_content";

async function turnItems(responseId, signal) {
  const id = path(responseId);
  const [inputs, response] = await Promise.all([
    call("GET", `/v1/responses/${id}/input_items?order=asc&limit=100&${ENCRYPTED}`, { signal }),
    call("GET", `/v1/responses/${id}?${ENCRYPTED}`, { signal }),
  ]).then((answers) => Promise.all(answers.map((answer) => answer.json())));
  return [...inputs.data, ...response.output];
}

// A Map turn -> its items (a turn whose items could not be read is left out).
export async function itemsByTurn(turns, signal) {
  const read = await Promise.all(
    turns.map((turn) => turnItems(turn.response_id, signal).then((items) => [turn.turn, items], () => null)),
  );
  return new Map(read.filter((entry) => entry !== null));
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
