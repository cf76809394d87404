// What the owner's committed turns cost (GET /api/v1/usage): over a range of UTC days (both
// included; by default the last 30), a line per day, model or conversation, then the total.
// The range and grouping live in the address: #/usage?from=DAY&to=DAY&group_by=….

import { json } from "./api.js";
import { errorBox, field, filterForm, h, show, utcDay } from "./dom.js";

const GROUPS = { day: "Day (UTC)", model: "Model", conversation: "Conversation" };
const COLUMNS = {
  turns: "Turns",
  input_tokens: "Input tokens",
  cached_tokens: "Cached",
  cache_write_tokens: "Cache writes",
  output_tokens: "Output tokens",
  reasoning_tokens: "Reasoning",
};

export async function usageView(main, signal, asked) {
  const today = new Date().toISOString().slice(0, 10);
  const from = asked.get("from") || utcDay(today, -29).slice(0, 10);
  const to = asked.get("to") || today;
  const group = asked.get("group_by") || "day";

  async function load() {
    const form = choice(from, to, group, load);
    show(main, h("h1", {}, "Usage"), form, h("p.muted", {}, "Loading…"));
    const query = new URLSearchParams({ from: utcDay(from), to: utcDay(to, 1), group_by: group });
    let body;
    try {
      ({ body } = await json("GET", `/api/v1/usage?${query}`, { signal }));
    } catch (error) {
      if (!signal.aborted) show(main, h("h1", {}, "Usage"), form, errorBox(error));
      return;
    }
    if (signal.aborted) return;
    const lines = body.data.length
      ? body.data.map((line) => row(line, group))
      : [h("tr", {}, h("td.muted", { colspan: 7 }, "No committed turns in this range."))];
    const total = h("tr", { id: "usage-total" }, h("th", { scope: "row" }, "Total"), numbers(body.total));
    const table = h(
      "table.usage",
      { dataset: { group } },
      h("caption.muted", {}, `Committed turns from ${from} to ${to} (UTC), tokens as each provider reported them.`),
      h("thead", {}, h("tr", {}, h("th", {}, GROUPS[group] || group), Object.values(COLUMNS).map((t) => h("th.num", {}, t)))),
      h("tbody", {}, lines),
      h("tfoot", {}, total),
    );
    show(main, h("h1", {}, "Usage"), form, table);
  }

  await load();
}

function choice(from, to, group, again) {
  const options = Object.entries(GROUPS).map(([value, label]) => h("option", { value, selected: value === group }, label));
  return filterForm("usage", "Usage range", [
    field("from", "From (UTC)", from, { type: "date", required: true }),
    field("to", "To (UTC)", to, { type: "date", required: true }),
    h("label", { for: "usage-group" }, "Grouped by", h("select", { id: "usage-group", name: "group_by" }, options)),
    h("div.actions", {}, h("button", { type: "submit", id: "show-usage" }, "Show")),
  ], again);
}

function row(line, group) {
  const key = group === "conversation" ? h("a.mono", { href: `#/conversations/${line.key}` }, line.key) : line.key;
  return h("tr", { dataset: { key: line.key } }, h("td", {}, key), numbers(line));
}

function numbers(line) {
  return Object.keys(COLUMNS).map((name) => h("td.num", { dataset: { field: name } }, line[name].toLocaleString()));
}
