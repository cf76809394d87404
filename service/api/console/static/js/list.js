// The owner's conversations, newest first (GET /api/v1/conversations), a page at a time,
// each with its /v1 metadata (GET /v1/conversations/{id}). The filters live in the address
// (#/?q=…&model=…&metadata=KEY=VALUE&updated_from=DAY&updated_to=DAY, days UTC and inclusive),
// so paging, reloading and going back keep them.

import { ApiError, convId, json, path } from "./api.js";
import { errorBox, field, filterForm, h, show, utcDay, when } from "./dom.js";
import * as run from "./run.js";

const PAGE = 20;
const cursors = [null]; // the cursor of each page seen, to go back

export async function listView(main, signal, asked = new URLSearchParams()) {
  let page = 0;
  const filtered = [...asked.keys()].length > 0;

  async function load() {
    const form = filters(asked, () => go(0));
    show(main, h("h1", {}, "Conversations"), form, h("p.muted", {}, "Loading…"));
    let body;
    try {
      const query = listing(asked);
      query.set("limit", String(PAGE));
      if (cursors[page]) query.set("after", cursors[page]);
      ({ body } = await json("GET", `/api/v1/conversations?${query}`, { signal }));
    } catch (error) {
      if (!signal.aborted) show(main, h("h1", {}, "Conversations"), form, errorBox(error));
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
    const none = filtered
      ? h("p.muted", { id: "no-match" }, "No conversation matches these filters.")
      : h("p.muted", {}, "No conversations yet. ", h("a", { href: "#/new" }, "Start one."));
    const table = rows.length
      ? h(
          "table.conversations",
          {},
          h("thead", {}, h("tr", {}, ["Conversation", "Revision", "Updated", "Created", "Metadata"].map((t) => h("th", {}, t)))),
          h("tbody", {}, rows),
        )
      : none;
    show(main, h("h1", {}, "Conversations"), runNote(), form, table, pager);
  }

  function go(to) {
    if (to === 0) cursors.length = 1;
    page = to;
    load();
  }

  cursors.length = 1;
  await load();
}

function filters(asked, again) {
  return filterForm("", "Find conversations", [
    field("q", "Words", asked.get("q"), { type: "search", placeholder: "all of them, whole words" }),
    field("model", "Model", asked.get("model"), { placeholder: "a turn used it" }),
    field("metadata", "Metadata", asked.get("metadata"), { placeholder: "KEY=VALUE", pattern: "[^=]+=.+", title: "KEY=VALUE" }),
    field("updated_from", "Updated from (UTC)", asked.get("updated_from"), { type: "date" }),
    field("updated_to", "Updated to (UTC)", asked.get("updated_to"), { type: "date" }),
    h("div.actions", {}, h("button", { type: "submit", id: "find" }, "Find"), h("a", { href: "#/" }, "Clear")),
  ], again);
}

// The API's query for the filters of the address.
function listing(asked) {
  const query = new URLSearchParams();
  for (const name of ["q", "model"]) if (asked.get(name)) query.set(name, asked.get(name));
  const pair = asked.get("metadata");
  if (pair) {
    const at = pair.indexOf("=");
    if (at < 1) throw new ApiError(400, "invalid_input", "A metadata filter is KEY=VALUE.");
    query.set(`metadata[${pair.slice(0, at)}]`, pair.slice(at + 1));
  }
  if (asked.get("updated_from")) query.set("updated_after", utcDay(asked.get("updated_from")));
  if (asked.get("updated_to")) query.set("updated_before", utcDay(asked.get("updated_to"), 1));
  return query;
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
