// The console's start: who is signing in, then the view the address names:
// #/ (conversations, #/?q=… with filters), #/new, #/conversations/<id>, #/usage?….

import { ApiError, call, session } from "./api.js";
import { conversationView } from "./conversation.js";
import { errorBox, h, show } from "./dom.js";
import { listView } from "./list.js";
import * as run from "./run.js";
import { newView } from "./turn.js";
import { usageView } from "./usage.js";

const main = document.getElementById("main");
let view = new AbortController();
let ready = false; // signed in: the views may call the API

// Signed in when the API answers this tab: with its key, or without one (AUTH_MODE=none).
async function signedIn() {
  try {
    await call("GET", "/api/v1/conversations?limit=1");
    return true;
  } catch (error) {
    if (error instanceof ApiError && error.status === 401) return false;
    throw error;
  }
}

function signInForm(problem) {
  const key = h("input", { type: "password", name: "key", id: "key", autocomplete: "off", required: true, "aria-label": "API key" });
  return h(
    "section.signin",
    {},
    h("h1", {}, "Sign in"),
    h("p", {}, "This turnstore asks for a key. The console sees what that key's owner sees through the public API, nothing more; the key stays in this tab (sessionStorage)."),
    h(
      "form",
      {
        onsubmit: async (event) => {
          event.preventDefault();
          session.signIn(key.value.trim());
          await start();
        },
      },
      h("label", { for: "key" }, "API key or JWT"),
      key,
      h("button", { type: "submit" }, "Sign in"),
    ),
    problem ? errorBox(problem) : null,
  );
}

async function start() {
  let ok;
  try {
    ok = await signedIn();
  } catch (error) {
    show(main, errorBox(error));
    return;
  }
  ready = ok;
  if (!ok) {
    const problem = session.key ? { message: "The server did not accept this key.", code: "unauthorized" } : null;
    session.signOut();
    header(false);
    show(main, signInForm(problem));
    main.querySelector("input")?.focus();
    return;
  }
  header(true);
  run.resume();
  await route();
}

function header(signedIn) {
  document.getElementById("sign-out").hidden = !(signedIn && session.key);
  const who = session.key ? "signed in with a key" : "no authentication (AUTH_MODE=none)";
  document.getElementById("who").textContent = signedIn ? who : "";
}

async function route() {
  if (!ready) return;
  view.abort();
  view = new AbortController();
  const [where, query] = (location.hash.slice(1) || "/").split("?");
  const [, name, id] = where.split("/");
  const asked = new URLSearchParams(query);
  if (name === "conversations" && id) await conversationView(main, view.signal, decodeURIComponent(id));
  else if (name === "new") newView(main, view.signal);
  else if (name === "usage") await usageView(main, view.signal, asked);
  else await listView(main, view.signal, asked);
}

document.getElementById("sign-out").addEventListener("click", () => {
  ready = false;
  view.abort();
  run.dismiss(); // this tab stops following its turn (the turn itself goes on)
  session.signOut();
  location.hash = "#/";
  start();
});
window.addEventListener("hashchange", () => route());
start();
