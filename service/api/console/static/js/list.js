// The owner's conversations, newest first (GET /api/v1/conversations), a page at a time,
// each with its /v1 metadata (GET /v1/conversations/{id}).

import { convId, json, path } from "./api.js";
import { errorBox, h, show, when } from "./dom.js";
import * as run from "./run.js";

const PAGE = 20;
const cursors = [null]; // the cursor of each page seen, to go back

export async function listView(main, signal) {
  let page = 0;

  async function load() {
    show(main, h("h1", {}, "Conversations"), h("p.muted", {}, "Loading…"));
    const query = new URLSearchParams({ limit: String(PAGE) });
    if (cursors[page]) query.set("after", cursors[page]);
    let body;
    try {
      ({ body } = await json("GET", `/api/v1/conversations?${query}`, { signal }));
    } catch (error) {
      if (!signal.aborted) show(main, h("h1", {}, "Conversations"), errorBox(error));
      return;
    }
    cursors[page + 1] = body.next;
    const metadata = await Promise.all(body.conversations.map((c) => metadataOf(c, signal)));
    if (signal.aborted) return;
    const rows = body.conversations.map((c, i) => row(c, metadata[i]));
    const pager = h(
      "nav.pager",
      {},
      h("button.quiet", { type: "button", disabled: page === 0, onclick: () => go(page - 1) }, "← Newer"),
      h("span.muted", {}, `page ${page + 1}`),
      h("button.quiet", { type: "button", id: "next-page", disabled: !body.next, onclick: () => go(page + 1) }, "Older →"),
    );
    const table = rows.length
      ? h(
          "table.conversations",
          {},
          h("thead", {}, h("tr", {}, ["Conversation", "Revision", "Updated", "Created", "Metadata"].map((t) => h("th", {}, t)))),
          h("tbody", {}, rows),
        )
      : h("p.muted", {}, "No conversations yet. ", h("a", { href: "#/new" }, "Start one."));
    show(main, h("h1", {}, "Conversations"), runNote(), table, pager);
  }

  function go(to) {
    page = to;
    load();
  }

  cursors.length = 1;
  await load();
}

async function metadataOf(conversation, signal) {
  try {
    const { body } = await json("GET", `/v1/conversations/${path(convId(conversation.conversation_id))}`, { signal });
    return body.metadata || {};
  } catch {
    return null; // shown as unknown; the row itself is still the owner's
  }
}

function row(conversation, metadata) {
  const id = conversation.conversation_id;
  const pairs = metadata === null ? [h("span.muted", {}, "?")] : Object.entries(metadata).map(([k, v]) => h("span.tag", {}, `${k}=${v}`));
  return h(
    "tr",
    { dataset: { id } },
    h("td", {}, h("a.mono", { href: `#/conversations/${id}` }, id)),
    h("td.num", {}, conversation.revision),
    h("td", {}, when(conversation.updated_at)),
    h("td", {}, when(conversation.created_at)),
    h("td", {}, pairs),
  );
}

function runNote() {
  const running = run.current();
  if (!running || running.state !== "running") return null;
  const target = running.new ? "#/new" : `#/conversations/${running.conversation_id}`;
  return h("p.note", {}, "A turn is running: ", h("a", { href: target }, "follow it"), ".");
}
