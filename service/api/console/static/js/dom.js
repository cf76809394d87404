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
