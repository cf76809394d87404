// Debian's Chromium driven by playwright-core (no browser download), for the console tests.

import { join } from "node:path";
import { chromium } from "playwright-core";

export const BASE = process.env.TURNSTORE_URL;
const SHOTS = process.env.SCREENSHOTS;

// The flags a closed network needs: no background connections, no component updates.
const FLAGS = [
  "--headless",
  "--no-sandbox",
  "--disable-gpu",
  "--disable-quic",
  "--no-first-run",
  "--disable-background-networking",
  "--disable-component-update",
  "--disable-sync",
];

// A fresh browser (playwright gives each launch a new, empty user data directory) and one
// page that records what it asked for and what went wrong in it.
export async function open() {
  const browser = await chromium.launch({
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    args: FLAGS,
  });
  const context = await browser.newContext({ viewport: { width: 1280, height: 860 } });
  const page = await context.newPage();
  page.setDefaultTimeout(30_000); // a shared 2-core machine under load: seen at 10 s
  const seen = { requests: [], problems: [] };
  page.on("request", (request) => {
    seen.requests.push({ url: request.url(), authorization: request.headers().authorization });
  });
  page.on("pageerror", (error) => seen.problems.push(`page error: ${error.message}`));
  page.on("console", (message) => {
    // A fetch answered 4xx is logged by Chromium itself; the console shows those on purpose.
    if (message.type() === "error" && !message.text().startsWith("Failed to load resource")) {
      seen.problems.push(`console: ${message.text()}`);
    }
  });
  return { browser, context, page, seen };
}

export async function shot(page, name) {
  if (SHOTS) await page.screenshot({ path: join(SHOTS, `${name}.png`) });
}

// The text of the first element matching selector (in a page or a locator), once it holds
// something that matches.
export async function textOf(scope, selector, pattern = /\S/) {
  const locator = scope.locator(selector).first();
  await locator.filter({ hasText: pattern }).waitFor();
  return (await locator.textContent()).trim();
}

// A call of the API from the test itself (not the page), e.g. to set up or to check.
export async function api(method, path, { key, body, headers = {} } = {}) {
  const sent = { ...headers };
  if (key) sent.Authorization = `Bearer ${key}`;
  if (body !== undefined) sent["Content-Type"] = "application/json";
  const response = await fetch(`${BASE}${path}`, {
    method,
    headers: sent,
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await response.text();
  return { status: response.status, headers: response.headers, body: text ? JSON.parse(text) : null };
}
