// A few DOM helpers: h("tag.class", {attributes}, ...children). Text is always set as text.

export function h(spec, attributes = {}, ...children) {
  const [tag, ...classes] = spec.split(".");
  const element = document.createElement(tag || "div");
  if (classes.length) element.className = classes.join(" ");
  for (const [name, value] of Object.entries(attributes)) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on")) element.addEventListener(name.slice(2), value);
    else if (name === "dataset") Object.assign(element.dataset, value);
    else element.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    element.append(child instanceof Node ? child : String(child));
  }
  return element;
}

export function show(container, ...children) {
  container.replaceChildren(...children.flat().filter(Boolean));
}

export function errorBox(error) {
  const code = error.code ? h("code", {}, error.code) : null;
  return h("p.error", { role: "alert" }, error.message || String(error), code ? " " : "", code);
}

export function when(iso) {
  if (!iso) return "";
  const date = typeof iso === "number" ? new Date(iso * 1000) : new Date(iso);
  return date.toLocaleString(undefined, { dateStyle: "medium", timeStyle: "medium" });
}

export function bytes(count) {
  return count < 1024 ? `${count} B` : `${(count / 1024).toFixed(1)} KiB`;
}

export function shorten(text, length = 240) {
  return text.length > length ? `${text.slice(0, length)}…` : text;
}

// The start of a UTC day (YYYY-MM-DD) some days later, in RFC 3339. What is not a day is left
// as typed, for the API to refuse by name.
export function utcDay(day, plus = 0) {
  const start = new Date(`${day}T00:00:00Z`);
  if (Number.isNaN(start.getTime())) return day;
  start.setUTCDate(start.getUTCDate() + plus);
  return start.toISOString().replace(".000Z", "Z");
}

// A form of labelled fields whose submission becomes the address #/<view>?<its fields>: the
// view shows again from its first page (at once when the address is already that one).
export function filterForm(view, label, fields, again) {
  return h(
    "form.filters",
    {
      role: "search",
      "aria-label": label,
      onsubmit: (event) => {
        event.preventDefault();
        const chosen = new URLSearchParams();
        for (const [name, value] of new FormData(event.target)) if (value.trim()) chosen.set(name, value);
        const target = `#/${view}${chosen.size ? `?${chosen}` : ""}`;
        if ((location.hash || "#/") === target) again();
        else location.hash = target;
      },
    },
    fields,
  );
}

// One labelled input of a filterForm, holding the value the address gave it.
export function field(name, label, value, attributes = {}) {
  const id = `filter-${name}`;
  const input = h("input", { id, name, value: value || undefined, ...attributes });
  return h("label", { for: id }, label, input);
}
