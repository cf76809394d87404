// The console's only way to the server: the public /api/v1 and /v1 APIs, with the key the
// user typed (kept in this tab's sessionStorage, sent as "Authorization: Bearer").

const KEY = "turnstore.key";

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export const session = {
  get key() {
    return sessionStorage.getItem(KEY);
  },
  signIn(key) {
    sessionStorage.setItem(KEY, key);
  },
  signOut() {
    sessionStorage.clear();
  },
};

// fetch with the key; a JSON body is sent as application/json (the server refuses any other
// body type). A non-2xx answer throws ApiError with the message of the error envelope.
export async function call(method, path, { body, headers = {}, signal } = {}) {
  const sent = new Headers(headers);
  if (session.key) sent.set("Authorization", `Bearer ${session.key}`);
  if (body !== undefined) sent.set("Content-Type", "application/json");
  const response = await fetch(path, {
    method,
    headers: sent,
    body: body === undefined ? undefined : JSON.stringify(body),
    signal,
    cache: "no-store",
  });
  if (!response.ok) throw await errorOf(response);
  return response;
}

// The answer's JSON body (null for 204) and its headers.
export async function json(method, path, options) {
  const response = await call(method, path, options);
  const body = response.status === 204 ? null : await response.json();
  return { body, headers: response.headers };
}

async function errorOf(response) {
  let code = `http_${response.status}`;
  let message = `The server answered ${response.status}.`;
  try {
    const error = (await response.json()).error;
    if (error && typeof error.message === "string") {
      message = error.message;
      code = error.code || code;
    }
  } catch {
    // not the envelope: keep the status
  }
  return new ApiError(response.status, code, message);
}

// "conv_<hex>" of a conversation uuid, as /v1 names it.
export function convId(uuid) {
  return `conv_${uuid.replaceAll("-", "")}`;
}

export function path(...parts) {
  return parts.map((part) => encodeURIComponent(part)).join("/");
}
