// The turn this tab is running: sent streamed with "background": true (so it runs on when the
// page goes away), its id (X-Turn-Id) and the last event id kept in sessionStorage, so that
// a reload resumes the same turn with GET /api/v1/turns/{id}/events and Last-Event-ID, on
// whichever replica the request reaches.

import { ApiError, call, path } from "./api.js";
import { events } from "./sse.js";

const RUN = "turnstore.run";
const listeners = new Set();
let following = null; // the run whose stream this page reads

export function current() {
  if (following) return following;
  try {
    return JSON.parse(sessionStorage.getItem(RUN));
  } catch {
    return null;
  }
}

export function onChange(listener) {
  listeners.add(listener);
  return () => listeners.delete(listener);
}

// Saved and told while this page follows the run (not once it was dismissed).
function changed(run) {
  if (following !== run) return;
  sessionStorage.setItem(RUN, JSON.stringify(run));
  for (const listener of listeners) listener(run);
}

// Start a turn; a refusal before the stream starts (bad input, unknown conversation, a
// busy conversation...) throws ApiError.
export async function send(message, conversationId) {
  const body = { message, conversation_id: conversationId || null, background: true };
  const response = await call("POST", "/api/v1/chat/stream", { body });
  const run = {
    turn_id: response.headers.get("X-Turn-Id"),
    conversation_id: response.headers.get("X-Conversation-Id"),
    new: !conversationId,
    message,
    last_event_id: 0,
    text: "",
    tools: [],
    state: "running",
    done: null,
    error: null,
    resumed: 0,
  };
  follow(run, response);
  return run;
}

// After a reload: follow the saved turn again from its last event.
export function resume() {
  const run = current();
  if (run && run.state === "running" && !following) follow(run, null);
}

export async function cancel(run) {
  const { turn_id } = run;
  await call("POST", `/api/v1/turns/${path(turn_id)}/cancel`);
}

export function dismiss() {
  sessionStorage.removeItem(RUN);
  following = null;
  for (const listener of listeners) listener(null);
}

async function follow(run, response) {
  following = run;
  changed(run);
  let failures = 0;
  while (run.state === "running") {
    try {
      if (!response) {
        const headers = { "Last-Event-ID": String(run.last_event_id) };
        response = await call("GET", `/api/v1/turns/${path(run.turn_id)}/events`, { headers });
        run.resumed += 1;
        changed(run);
      }
      for await (const event of events(response)) {
        apply(run, event);
        failures = 0;
        changed(run);
      }
      // A stream that ends without its terminal event: the replica went away. Resume.
    } catch (error) {
      if (error instanceof ApiError) {
        run.state = "failed";
        run.error = { code: error.code, message: error.message };
      } else if (++failures > 3) {
        run.state = "lost";
        run.error = { code: "network", message: "The stream was lost: reload to resume." };
      } else {
        await new Promise((resolve) => setTimeout(resolve, 300 * failures));
      }
    }
    response = null;
  }
  changed(run);
  if (following === run) following = null;
}

function apply(run, event) {
  const id = Number(event.id);
  if (Number.isInteger(id) && id > 0) {
    if (id <= run.last_event_id) return; // seen already
    run.last_event_id = id;
  }
  let data;
  try {
    data = JSON.parse(event.data);
  } catch {
    return;
  }
  if (event.event === "message.delta") run.text += data.delta;
  else if (event.event === "tool.call") run.tools.push(data);
  else if (event.event === "message.done") {
    run.state = "done";
    run.done = data;
    if (data.conversation_id) run.conversation_id = data.conversation_id;
  } else if (event.event === "error") {
    run.state = "failed";
    run.error = data.error || { code: "error", message: "The turn failed." };
  }
}
