// One conversation: its turns (GET /api/v1/conversations/{id}) beside the replay items of each
// turn (GET /v1/conversations/{id}/items), the running turn, fork, delete.

import { convId, json, path } from "./api.js";
import { bytes, errorBox, h, shorten, show, when } from "./dom.js";
import { describe, itemsByTurn, size } from "./items.js";
import * as run from "./run.js";
import { composer, runPanel } from "./turn.js";

const TURNS = 20;
const LATEST = 2147483647; // "before" alone: the latest turns before it

export async function conversationView(main, signal, id) {
  let before = LATEST;
  let after = null;
  let shown = null; // the conversation as last read
  let compose = null; // kept across readings: a draft survives them

  async function load() {
    const query = new URLSearchParams({ limit: String(TURNS) });
    if (after !== null) query.set("after", String(after));
    else query.set("before", String(before));
    let view;
    let etag;
    try {
      const answer = await json("GET", `/api/v1/conversations/${path(id)}?${query}`, { signal });
      view = answer.body;
      etag = answer.headers.get("ETag");
    } catch (error) {
      if (!signal.aborted) show(main, h("h1", {}, "Conversation"), h("p.mono", {}, id), errorBox(error));
      return;
    }
    const last = view.turns.length ? view.turns.at(-1).turn : 0;
    const [items, meta, forks] = await Promise.all([
      last ? itemsByTurn(view.turns, signal).catch((error) => error) : new Map(),
      json("GET", `/v1/conversations/${path(convId(view.conversation_id))}`, { signal }).then((a) => a.body, () => null),
      forksOf(view, signal),
    ]);
    if (signal.aborted) return;
    shown = view;
    render(view, etag, items, meta, forks);
  }

  function render(view, etag, items, meta, forks) {
    const header = h(
      "section.summary",
      {},
      h("h1", {}, "Conversation ", h("span.mono", {}, view.conversation_id)),
      h(
        "dl.facts",
        {},
        fact("Revision", h("span", { id: "revision" }, view.revision)),
        fact("ETag", h("code", {}, etag || "")),
        fact("Window starts at turn", h("span", { id: "window" }, view.context_start)),
        fact("/v1 id", h("code", {}, convId(view.conversation_id))),
        fact("Created", when(view.created_at)),
        fact("Updated", when(view.updated_at)),
        fact("Metadata", meta ? Object.entries(meta.metadata || {}).map(([k, v]) => h("span.tag", {}, `${k}=${v}`)) : "?"),
        "forked_from" in view ? fact("Forked from", origin(view.forked_from)) : null,
      ),
      h(
        "div.actions",
        {},
        h("button.quiet", { type: "button", onclick: () => load() }, "Refresh"),
        h("button.danger", { type: "button", id: "delete", onclick: () => remove(view) }, "Delete…"),
      ),
      forks,
    );
    const pager = h(
      "nav.pager",
      {},
      h("button.quiet", { type: "button", disabled: !view.more_before, onclick: () => page(null, view.turns[0].turn) }, "← Earlier turns"),
      h("button.quiet", { type: "button", disabled: !view.more_after, onclick: () => page(view.turns.at(-1).turn, null) }, "Later turns →"),
    );
    const turns = view.turns.length
      ? view.turns.map((turn, i) => turnRow(view, turn, messagesOf(view, i), items))
      : [h("p.muted", {}, "No turns yet.")];
    const itemsError = items instanceof Error ? errorBox(items) : null;
    const paired = view.messages.length === 2 * view.turns.length;
    const transcript = paired ? null : h("section.turn.flat", {}, h("h3", {}, "Transcript"), view.messages.map(message));
    const running = h("div", { id: "running" });
    show(main, header, itemsError, view.more_before || view.more_after ? pager : null, transcript, h("div.turns", {}, turns), running, (compose ??= composer(view.conversation_id)));
    follow(running, view.conversation_id);
  }

  function page(afterTurn, beforeTurn) {
    after = afterTurn;
    before = beforeTurn ?? LATEST;
    load();
  }

  async function fork(view, turn) {
    try {
      const { body } = await json("POST", `/api/v1/conversations/${path(view.conversation_id)}/fork`, {
        body: { at_revision: turn },
      });
      location.hash = `#/conversations/${body.conversation_id}`;
    } catch (error) {
      main.prepend(errorBox(error));
    }
  }

  async function remove(view) {
    const dialog = document.getElementById("confirm");
    document.getElementById("confirm-text").textContent =
      `Delete conversation ${view.conversation_id} (revision ${view.revision})? ` +
      "Its transcript and replay items are gone for good.";
    dialog.returnValue = "";
    dialog.showModal();
    const choice = await new Promise((resolve) => dialog.addEventListener("close", () => resolve(dialog.returnValue), { once: true }));
    if (choice !== "delete") return;
    try {
      // If-Match: the revision shown; a turn committed since makes it 412, nothing deleted.
      await json("DELETE", `/api/v1/conversations/${path(view.conversation_id)}`, {
        headers: { "If-Match": `"${view.revision}"` },
      });
      location.hash = "#/";
    } catch (error) {
      main.prepend(errorBox(error));
    }
  }

  // The running turn of this conversation, if any; when it commits, read the conversation again.
  function follow(container, conversationId) {
    const update = (current) => {
      if (!container.isConnected) return stop();
      const mine = current && current.conversation_id === conversationId && !current.new;
      show(container, mine ? runPanel(current) : null);
      if (mine && current.state === "done" && current.done?.revision != null) {
        stop();
        run.dismiss();
        load();
      }
    };
    const stop = run.onChange(update);
    signal.addEventListener("abort", stop);
    update(run.current());
  }

  function turnRow(view, turn, messages, items) {
    const found = items instanceof Map ? items.get(turn.turn) : undefined;
    const left = h(
      "div.transcript",
      {},
      messages.map(message),
      turnFacts(turn),
    );
    const right = h(
      "div.items",
      {},
      h("h3", {}, "Replay items ", h("code", {}, turn.response_id)),
      found ? itemTable(found) : h("p.muted", {}, "Items not read."),
    );
    return h(
      `article.turn${turn.turn < view.context_start ? ".outside" : ""}`,
      { dataset: { turn: turn.turn } },
      h(
        "header",
        {},
        h("h2", {}, `Turn ${turn.turn}`),
        turn.turn < view.context_start ? h("span.tag.warn", {}, "out of the window") : null,
        h("button.quiet.fork", { type: "button", onclick: () => fork(view, turn.turn) }, "Fork here"),
      ),
      h("div.pair", {}, left, right),
    );
  }

  await load();
  return () => shown;
}

function messagesOf(view, index) {
  // Two messages per turn (user, assistant), in the order of the turns; any other shape is
  // shown as one transcript above the turns.
  return view.messages.length === 2 * view.turns.length ? view.messages.slice(2 * index, 2 * index + 2) : [];
}

function message(m) {
  const label = m.in_context === false ? `${m.role} · out of the window` : m.role;
  return h(`div.message.${m.role}${m.in_context === false ? ".out" : ""}`, {}, h("span.role", {}, label), h("p", {}, m.content));
}

function turnFacts(turn) {
  const facts = [fact("Context from turn", turn.context_from)];
  if (turn.model) facts.push(fact("Model", turn.model));
  if (turn.usage) facts.push(fact("Usage", usage(turn.usage)));
  if (turn.prompt_version) facts.push(fact("Prompt", h("code", {}, shorten(turn.prompt_version, 16))));
  if (turn.tool_calls && turn.tool_calls.length) {
    facts.push(
      fact(
        "Tool calls",
        h(
          "ul.calls",
          {},
          turn.tool_calls.map((c) => h("li", {}, h("code", {}, `${c.name}(${shorten(c.arguments, 80)})`), ` ${c.status}`, c.accepted ? "" : " (refused)", ` ${Math.round(c.duration_ms)} ms`)),
        ),
      ),
    );
  }
  return h("dl.facts.small", {}, facts);
}

function usage(u) {
  const parts = [`${u.input_tokens ?? "?"} in`, `${u.output_tokens ?? "?"} out`];
  const cached = u.input_tokens_details?.cached_tokens;
  const reasoning = u.output_tokens_details?.reasoning_tokens;
  if (cached) parts.push(`${cached} cached`);
  if (reasoning) parts.push(`${reasoning} reasoning`);
  return `${parts.join(", ")} tokens`;
}

function itemTable(items) {
  return h(
    "table.items",
    {},
    h("thead", {}, h("tr", {}, ["Type", "Id", "Role", "Bytes", "Content"].map((t) => h("th", {}, t)))),
    h(
      "tbody",
      {},
      items.map((item) => {
        const said = describe(item);
        const content = said.sealed !== undefined ? [h("span.sealed", {}, said.sealed ? `sealed, ${said.sealed} bytes` : "sealed"), said.text ? ` ${shorten(said.text)}` : ""] : shorten(said.text);
        return h(
          "tr",
          { dataset: { type: item.type } },
          h("td", {}, item.type),
          h("td.mono", {}, item.id),
          h("td", {}, item.role || ""),
          h("td.num", { title: "size of the item as listed" }, bytes(size(item))),
          h("td", {}, content),
        );
      }),
    ),
  );
}

function fact(name, ...value) {
  return h("div", {}, h("dt", {}, name), h("dd", {}, ...value));
}

function origin(forkedFrom) {
  if (!forkedFrom) return "—";
  const revision = forkedFrom.at_revision ?? forkedFrom.revision;
  return h("span", {}, h("a.mono", { href: `#/conversations/${forkedFrom.conversation_id}` }, forkedFrom.conversation_id), ` at revision ${revision}`);
}

// The forks made from this conversation, where the server can list them (a body that names
// forked_from comes with the forked_from filter of the listing); nothing otherwise.
async function forksOf(view, signal) {
  if (!("forked_from" in view)) return null;
  const query = new URLSearchParams({ forked_from: view.conversation_id, limit: "20" });
  try {
    const { body } = await json("GET", `/api/v1/conversations?${query}`, { signal });
    if (body.conversations.some((c) => c.conversation_id === view.conversation_id)) return null; // filter not applied
    const links = body.conversations.map((c) => h("li", {}, h("a.mono", { href: `#/conversations/${c.conversation_id}` }, c.conversation_id), ` revision ${c.revision}`));
    return h("div.forks", {}, h("h3", {}, "Forks made from it"), links.length ? h("ul", {}, links) : h("p.muted", {}, "None."));
  } catch {
    return null;
  }
}
