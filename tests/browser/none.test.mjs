// The console with AUTH_MODE=none (no key, no sign-in), and /schema/swagger rendering with
// every request off this machine refused (tests/test_console.py).

import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import { BASE, api, open, shot, textOf } from "./browser.mjs";

let browser;
let context;
let page;
let seen;

before(async () => {
  ({ browser, context, page, seen } = await open());
});

after(async () => {
  await browser?.close();
});

test("needs no key: straight to the conversations", async () => {
  await page.goto(`${BASE}/console/`);
  await page.locator("h1", { hasText: "Conversations" }).waitFor();
  assert.match(await textOf(page, "#who"), /no authentication/);
  assert.equal(await page.locator("#sign-out").isVisible(), false);
  assert.equal(await page.locator("#key").count(), 0);
});

test("starts a conversation with a streamed turn", async () => {
  await page.click("nav >> text=New conversation");
  await page.fill("textarea[name=message]", "hello without a key");
  await page.click("#send");
  await page.waitForFunction(() => location.hash.startsWith("#/conversations/"));
  assert.equal(await textOf(page, "#revision", /1/), "1");
  assert.match(await page.locator("article.turn .message.assistant").textContent(), /\[fake-llm\] hello without a key/);
  const id = page.url().split("#/conversations/")[1];
  assert.equal((await api("GET", `/api/v1/conversations/${id}`)).body.revision, 1);
  // Two more turns: with CONTEXT_MAX_TURNS=1 the first leaves the model's window.
  for (const [message, revision] of [["a second one", "2"], ["a third one", "3"]]) {
    await page.fill("textarea[name=message]", message);
    await page.click("#send");
    assert.equal(await textOf(page, "#revision", new RegExp(revision)), revision);
  }
  assert.equal(await textOf(page, "#window"), "2");
  const first = page.locator('article.turn[data-turn="1"]');
  assert.match(await first.locator("header").textContent(), /out of the window/);
  assert.match(await first.locator(".message.user .role").textContent(), /out of the window/);
  assert.doesNotMatch(await page.locator('article.turn[data-turn="2"]').textContent(), /out of the window/);
  assert.match(await page.locator('article.turn[data-turn="3"] .transcript').textContent(), /Context from turn2/);
  for (const { url, authorization } of seen.requests) {
    assert.ok(url.startsWith(`${BASE}/`), url);
    assert.equal(authorization, undefined, url);
  }
  assert.deepEqual(seen.problems, []);
});

test("/schema/swagger renders every operation with no network", async () => {
  const refused = [];
  await context.route("**/*", (route) => {
    const url = new URL(route.request().url());
    if (url.hostname === "127.0.0.1" || url.hostname === "localhost") return route.continue();
    refused.push(url.href);
    return route.abort("internetdisconnected");
  });
  const schema = (await api("GET", "/schema")).body;
  const operations = Object.values(schema.paths).flatMap((item) => Object.keys(item).filter((k) => k !== "parameters"));
  const tags = new Set(Object.values(schema.paths).flatMap((item) => Object.values(item).flatMap((op) => op.tags || [])));
  assert.ok(operations.length >= 20, operations.length);
  await page.goto(`${BASE}/schema/swagger`);
  await page.locator(".opblock").nth(operations.length - 1).waitFor();
  assert.equal(await page.locator(".opblock").count(), operations.length);
  assert.equal(await page.locator(".opblock-tag-section").count(), tags.size);
  assert.match(await page.locator(".info .title").textContent(), /turnstore/);
  await shot(page, "swagger");
  assert.deepEqual(refused, []); // it did not even try
});
