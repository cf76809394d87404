// Sending a turn and watching it: the composer, the running turn's panel (deltas as they
// arrive, its id, the last event id, cancel) and the view of a new conversation.

import { errorBox, h, show } from "./dom.js";
import * as run from "./run.js";

export function composer(conversationId) {
  const text = h("textarea", { name: "message", rows: 3, required: true, placeholder: "Message", "aria-label": "Message" });
  const problem = h("div");
  const button = h("button", { type: "submit", id: "send" }, "Send (streamed)");
  const busy = () => run.current()?.state === "running";
  const form = h(
    "form.composer",
    {
      onsubmit: async (event) => {
        event.preventDefault();
        if (!text.value.trim()) return;
        if (busy()) {
          show(problem, errorBox({ message: "A turn sent from this tab is still running: one at a time.", code: "busy" }));
          return;
        }
        button.disabled = true;
        show(problem);
        try {
          await run.send(text.value, conversationId);
          text.value = "";
        } catch (error) {
          show(problem, errorBox(error));
        } finally {
          button.disabled = false;
        }
      },
    },
    text,
    h("div.actions", {}, button, h("span.muted", {}, "The turn runs in the background: reload the page and it goes on.")),
    problem,
  );
  return form;
}

export function runPanel(current) {
  const state = {
    running: "running",
    done: current.done?.revision != null ? `committed as revision ${current.done.revision}` : `done (${current.done?.status}), nothing committed`,
    failed: "ended",
    lost: "lost",
  }[current.state];
  const cancel = h(
    "button.danger",
    {
      type: "button",
      id: "cancel",
      onclick: async () => {
        cancel.disabled = true;
        try {
          await run.cancel(current);
        } catch (error) {
          cancel.after(errorBox(error));
        }
      },
    },
    "Cancel turn",
  );
  const dismiss = h("button.quiet", { type: "button", onclick: () => run.dismiss() }, "Dismiss");
  return h(
    `section.run.${current.state}`,
    { "aria-label": "running turn" },
    h(
      "header",
      {},
      h("h2", {}, "Turn ", h("code.turn-id", {}, current.turn_id)),
      h("span.tag.state", {}, state),
      h("span.muted", {}, `event ${current.last_event_id}`, current.resumed ? `, resumed ${current.resumed}×` : ""),
      current.state === "running" ? cancel : dismiss,
    ),
    h("div.message.user", {}, h("span.role", {}, "user"), h("p", {}, current.message)),
    h("div.message.assistant", {}, h("span.role", {}, "assistant"), h("p.deltas", {}, current.text, current.state === "running" ? h("span.cursor", {}, "▍") : null)),
    current.tools.length ? h("ul.calls", {}, current.tools.map((t) => h("li", {}, `${t.name}: ${t.status}`))) : null,
    current.error ? errorBox(current.error) : null,
  );
}

// #/new: the first turn of a new conversation; once it commits, open the conversation.
export function newView(main, signal) {
  const panel = h("div", { id: "running" });
  show(main, h("h1", {}, "New conversation"), panel, composer(null));
  const update = (current) => {
    const mine = current && current.new;
    show(panel, mine ? runPanel(current) : null);
    if (mine && current.state === "done" && current.done?.revision != null) {
      stop();
      run.dismiss();
      location.hash = `#/conversations/${current.conversation_id}`;
    }
  };
  const stop = run.onChange(update);
  signal.addEventListener("abort", stop);
  update(run.current());
}
