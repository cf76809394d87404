// The fake Responses API behind the served turnstore (tests/test_v1_clients_js.py adds these
// routes beside the app): script the provider's next answers, read what it received.
export const TURNSTORE = process.env.TURNSTORE_URL;
export const BASE_URL = `${TURNSTORE}/v1`;

// The next provider calls answer these, in order (fields of tests/fakeapi.py's Script:
// `text`, `calls: [[name, arguments]]`, `deltas`...; `{}` answers "reply <n>"); the requests
// seen so far are forgotten.
export async function answers(...scripts) {
  const response = await fetch(`${TURNSTORE}/_fake/answers`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify(scripts),
  });
  if (!response.ok) throw new Error(`scripting the fake: ${response.status}`);
}

// The request bodies the provider received since the last `answers`.
export async function received() {
  return (await fetch(`${TURNSTORE}/_fake/requests`)).json();
}

// Each call of the fake reports this usage (tests/fakeapi.py).
export const CALL_USAGE = { input: 10, output: 5, total: 15 };

export const kinds = (request) => request.input.map((item) => item.type ?? "message");

export function pick(object, names) {
  return Object.fromEntries(names.map((name) => [name, object[name]]));
}
