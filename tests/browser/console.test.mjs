// The console with AUTH_MODE=api_key, behind a balancer of two replicas (tests/test_console.py):
// sign in, list, find, usage, open, send a streamed turn, reload mid-stream and resume on the other
// replica, cancel, fork, delete, another owner's conversation, sign out.

import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import { BASE, api, open, shot, textOf } from "./browser.mjs";

const ALICE = process.env.ALICE_KEY;
const BOB_CONVERSATION = process.env.BOB_CONVERSATION;

let browser;
let page;
let seen;
let conversation; // alice's conversation with two turns (the newest)
const signedIn = {}; // request indexes while signed in

async function control(action) {
  const response = await fetch(`${BASE}/__test/${action}`, { method: "POST" });
  assert.equal(response.status, 200);
  return response.json();
}

async function sendFromPage(message) {
  await page.fill("textarea[name=message]", message);
  await page.click("#send");
  await page.locator("section.run .deltas").filter({ hasText: "[fake" }).waitFor();
  return textOf(page, "section.run .turn-id");
}

async function run() {
  return page.evaluate(() => JSON.parse(sessionStorage.getItem("turnstore.run")));
}

before(async () => {
  ({ browser, page, seen } = await open());
  // Twenty-one conversations with metadata only (page 2 of the list), then the newest, with
  // two turns.
  for (let n = 1; n <= 21; n++) {
    const made = await api("POST", "/v1/conversations", { key: ALICE, body: { metadata: { n: String(n) } } });
    assert.equal(made.status, 200);
  }
  const first = await api("POST", "/api/v1/chat", { key: ALICE, body: { message: "hello" } });
  assert.equal(first.status, 200);
  conversation = first.body.conversation_id;
  const body = { message: "and again", conversation_id: conversation };
  assert.equal((await api("POST", "/api/v1/chat", { key: ALICE, body })).status, 200);
  const topic = await api("POST", `/v1/conversations/${conversation}`, {
    key: ALICE,
    body: { metadata: { topic: "console demo" } },
  });
  assert.equal(topic.status, 200);
});

after(async () => {
  await browser?.close();
});

test("signs in with an API key, kept in the tab only", async () => {
  await page.goto(`${BASE}/console/`);
  await page.locator("#key").waitFor();
  await shot(page, "sign-in");
  await page.fill("#key", "not-a-key");
  await page.click("button[type=submit]");
  assert.match(await textOf(page, ".signin [role=alert]"), /did not accept this key/);
  await page.fill("#key", ALICE);
  signedIn.from = seen.requests.length;
  await page.click("button[type=submit]");
  await page.locator("table.conversations").waitFor();
  assert.equal(await page.evaluate(() => sessionStorage.getItem("turnstore.key")), ALICE);
  assert.equal(await page.evaluate(() => localStorage.length), 0);
  assert.match(await textOf(page, "#who"), /signed in with a key/);
});

test("lists the owner's conversations newest first, with metadata, a page at a time", async () => {
  const rows = page.locator("table.conversations tbody tr");
  await page.locator(`tr[data-id="${conversation}"]`).filter({ hasText: "topic=console demo" }).waitFor();
  assert.equal(await rows.count(), 20);
  assert.equal(await rows.nth(0).getAttribute("data-id"), conversation);
  assert.match(await rows.nth(1).textContent(), /n=21/);
  assert.match(await rows.nth(19).textContent(), /n=3\b/);
  await shot(page, "conversations");
  await page.click("#next-page");
  await page.locator("tbody tr").filter({ hasText: "n=1" }).waitFor();
  const older = await rows.allTextContents();
  assert.equal(older.length, 2);
  assert.match(older[0], /n=2\b/);
  assert.match(older[1], /n=1\b/);
  assert.equal(await page.locator("#next-page").isDisabled(), true);
  assert.ok(!(await page.content()).includes(BOB_CONVERSATION));
});

// The ids the list shows once it is drawn again after action (what was shown before is marked
// stale): a table, "no match" or an error.
async function relisted(action) {
  await page.evaluate(() => document.querySelectorAll("main > *").forEach((e) => e.classList.add("stale")));
  await action();
  await page.locator("main > :is(table.conversations, #no-match, [role=alert]):not(.stale)").waitFor();
  return page.locator("table.conversations tbody tr").evaluateAll((rows) => rows.map((r) => r.dataset.id));
}

async function find(filters) {
  return relisted(async () => {
    for (const [name, value] of Object.entries({ q: "", model: "", metadata: "", updated_from: "", updated_to: "", ...filters })) {
      await page.fill(`#filter-${name}`, value);
    }
    await page.click("#find");
  });
}

function utcDay(plus = 0) {
  return new Date(Date.now() + plus * 86_400_000).toISOString().slice(0, 10);
}

let lighthouse;
let harbour;

test("finds conversations by words, model, metadata and day; paging keeps the filters", async () => {
  const said = async (body) => (await api("POST", "/api/v1/chat", { key: ALICE, body })).body.conversation_id;
  lighthouse = await said({ message: "the Lighthouse keeper" });
  harbour = await said({ message: "a quiet harbour", model: "fake-harbour" });
  assert.ok(lighthouse && harbour);
  await page.goto(`${BASE}/console/#/`);
  await page.reload();
  await page.locator(`tr[data-id="${harbour}"]`).waitFor();
  assert.deepEqual(await find({ q: "LIGHTHOUSE" }), [lighthouse]);
  assert.equal(await page.evaluate(() => location.hash), "#/?q=LIGHTHOUSE");
  assert.equal(await page.inputValue("#filter-q"), "LIGHTHOUSE");
  await shot(page, "search");
  assert.deepEqual(await find({ q: "lighthouse keeper" }), [lighthouse]);
  assert.deepEqual(await find({ q: "lighthouse harbour" }), []);
  assert.match(await textOf(page, "#no-match"), /No conversation matches/);
  assert.deepEqual(await find({ model: "fake-harbour" }), [harbour]);
  assert.deepEqual(await find({ metadata: "topic=console demo" }), [conversation]);
  const seven = await find({ metadata: "n=7", updated_to: utcDay() });
  assert.equal(seven.length, 1);
  assert.match(await page.locator(`tr[data-id="${seven[0]}"]`).textContent(), /n=7\b/);
  assert.deepEqual(await find({ updated_from: utcDay(1) }), []);
  assert.deepEqual(await find({ updated_to: utcDay(-1) }), []);
  // All 24 of alice's, updated today: the second page is asked with the same filter.
  assert.equal((await find({ updated_from: utcDay() })).length, 20);
  const second = await relisted(() => page.click("#next-page"));
  assert.equal(second.length, 4);
  const asked = new URL(seen.requests.filter(({ url }) => url.includes("/api/v1/conversations?")).at(-1).url);
  assert.equal(asked.searchParams.get("updated_after"), `${utcDay()}T00:00:00Z`);
  assert.ok(asked.searchParams.get("after"));
  assert.ok(!second.includes(BOB_CONVERSATION));
});

test("a filter the API refuses shows its error, not an empty list", async () => {
  assert.deepEqual(await find({ q: ",,," }), []);
  assert.match(await textOf(page, "main > [role=alert]"), /q has no word to search for\.\s*invalid_input/);
  assert.equal(await page.locator("#no-match").count(), 0);
  assert.equal(await page.inputValue("#filter-q"), ",,,"); // kept, to be corrected
  // An address typed by hand is judged by the API too.
  await relisted(() => page.goto(`${BASE}/console/#/?updated_from=yesterday`));
  assert.match(await textOf(page, "main > [role=alert]"), /updated_after must be an RFC 3339 date/);
});

test("shows usage totals for the last 30 days by day, model and conversation, as the API sums them", async () => {
  await page.click("nav >> text=Usage");
  await page.locator("table.usage").waitFor();
  assert.equal(await page.inputValue("#filter-to"), utcDay());
  assert.equal(await page.inputValue("#filter-from"), utcDay(-29));
  const everything = await api("GET", "/api/v1/usage", { key: ALICE }); // the API's own default: 30 days
  assert.equal(everything.body.total.turns, 4); // hello, and again, lighthouse, harbour
  for (const group of ["model", "conversation", "day"]) {
    await page.evaluate(() => document.querySelectorAll("main > *").forEach((e) => e.classList.add("stale")));
    await page.selectOption("#usage-group", group);
    await page.click("#show-usage");
    const table = page.locator(`table.usage[data-group="${group}"]:not(.stale)`);
    await table.waitFor();
    const asked = new URL(seen.requests.filter(({ url }) => url.includes("/api/v1/usage?")).at(-1).url);
    assert.equal(asked.searchParams.get("from"), `${utcDay(-29)}T00:00:00Z`);
    assert.equal(asked.searchParams.get("to"), `${utcDay(1)}T00:00:00Z`);
    const expected = await api("GET", `/api/v1/usage${asked.search}`, { key: ALICE });
    assert.deepEqual(expected.body.total, everything.body.total);
    const shown = await table.evaluate((t) => {
      const numbers = (row) => Object.fromEntries([...row.querySelectorAll("td.num")].map((td) => [td.dataset.field, Number(td.textContent.replace(/\D/g, ""))]));
      return {
        data: [...t.querySelectorAll("tbody tr")].map((row) => ({ key: row.dataset.key, ...numbers(row) })),
        total: { key: "total", ...numbers(t.querySelector("tfoot tr")) },
      };
    });
    assert.deepEqual(shown, expected.body);
    if (group === "model") assert.ok(shown.data.some((line) => line.key === "fake-harbour"));
    if (group === "conversation") {
      assert.deepEqual(new Set(shown.data.map((line) => line.key)), new Set([conversation, lighthouse, harbour]));
      await table.locator(`a[href="#/conversations/${harbour}"]`).waitFor();
      await shot(page, "usage");
    }
  }
  assert.ok(!(await page.content()).includes(BOB_CONVERSATION));
});

test("opens a conversation: each turn's transcript beside its replay items, sealed content only sized", async () => {
  await page.goto(`${BASE}/console/#/`);
  await page.click(`tr[data-id="${conversation}"] a`);
  assert.equal(await textOf(page, "#revision"), "2");
  assert.match(await page.locator(".summary").textContent(), /"2"/); // the ETag
  assert.equal(await page.locator("article.turn").count(), 2);
  const second = page.locator('article.turn[data-turn="2"]');
  assert.match(await second.locator(".message.assistant").textContent(), /\[fake-llm\] and again \(history=2\)/);
  const types = await second.locator(".items tbody tr").evaluateAll((rows) => rows.map((r) => r.dataset.type));
  assert.deepEqual(types, ["message", "reasoning", "message"]);
  const reasoning = second.locator('.items tr[data-type="reasoning"]');
  assert.match(await reasoning.textContent(), /sealed, \d+ bytes/);
  // The sealed bytes are never shown.
  const listed = await api("GET", `/v1/conversations/${conversation}/items?include[]=reasoning.encrypted_content`, { key: ALICE });
  const sealed = listed.body.data.find((item) => item.type === "reasoning").encrypted_content;
  assert.ok(sealed.length > 20 && !(await page.content()).includes(sealed.slice(0, 20)));
  // The turn's /v1 Response, by its opaque id (the transcript names it).
  const view = await api("GET", `/api/v1/conversations/${conversation}`, { key: ALICE });
  assert.match(await second.locator(".items h3").textContent(), new RegExp(view.body.turns[1].response_id));
  assert.match(view.body.turns[1].response_id, /^resp_ts[a-z2-7]+$/);
  if (!("usage" in view.body.turns[0])) assert.doesNotMatch(await second.textContent(), /Usage/);
  await shot(page, "conversation");
});

test("shows a turn's model and usage, and compaction items sealed, where the API gives them", async () => {
  // The page's side only: the answers are edited on their way to it.
  const usage = {
    input_tokens: 812, output_tokens: 64, total_tokens: 876,
    input_tokens_details: { cached_tokens: 512 }, output_tokens_details: { reasoning_tokens: 21 },
  };
  const sealed = "c0mpacted".repeat(40);
  const transcript = /\/api\/v1\/conversations\/[^/?]+\?/;
  const items = /\/v1\/responses\/resp_[a-z2-7]+\?/; // a turn's Response: its output
  await page.route(transcript, async (route) => {
    const response = await route.fetch();
    const body = await response.json();
    for (const turn of body.turns) Object.assign(turn, { model: "gpt-test", usage });
    await route.fulfill({ response, json: body });
  });
  await page.route(items, async (route) => {
    const response = await route.fetch();
    const body = await response.json();
    body.output.unshift({ type: "compaction", id: "cmp_test", encrypted_content: sealed }); // as a compacting turn's
    await route.fulfill({ response, json: body });
  });
  await page.reload();
  const second = page.locator('article.turn[data-turn="2"]');
  assert.match(await textOf(second, ".transcript", /Usage/), /Modelgpt-test.*Usage812 in, 64 out, 512 cached, 21 reasoning tokens/);
  const compaction = second.locator('.items tr[data-type="compaction"]');
  assert.match(await compaction.textContent(), new RegExp(`sealed, ${sealed.length} bytes`));
  assert.ok(!(await page.content()).includes(sealed.slice(0, 27)));
  await page.unroute(transcript);
  await page.unroute(items);
});

test("sends a streamed turn; a reload mid-stream resumes the same turn on the other replica", async () => {
  const turnId = await sendFromPage("slow: tell me more");
  const saved = await run();
  assert.equal(saved.turn_id, turnId);
  const before = saved.last_event_id;
  assert.ok(before >= 1 && saved.text.length > 0, JSON.stringify(saved));
  assert.equal((await control("switch")).replica, "b");
  const resumed = page.waitForResponse((r) => r.url().includes(`/api/v1/turns/${turnId}/events`));
  await page.reload();
  const response = await resumed;
  assert.equal(response.request().headers()["last-event-id"], String(before));
  assert.equal(response.headers()["x-test-replica"], "b");
  assert.equal(await textOf(page, "section.run .turn-id"), turnId);
  assert.match(await textOf(page, "section.run header"), /resumed 1×/);
  assert.equal(await page.locator("section.run .deltas").textContent().then((t) => t.replace("▍", "")), saved.text);
  await page.locator("#send").scrollIntoViewIfNeeded();
  await shot(page, "streaming");
  await control("release");
  await page.locator("section.run").waitFor({ state: "detached" });
  assert.equal(await textOf(page, "#revision", /3/), "3");
  const third = page.locator('article.turn[data-turn="3"] .message.assistant');
  assert.match(await third.textContent(), /\[fake-llm\] slow: tell me more \(history=4\)/);
  assert.equal(await run(), null);
});

test("cancels a running turn: nothing is kept", async () => {
  await sendFromPage("slow: never mind");
  await page.click("#cancel");
  await page.locator("section.run.failed").waitFor();
  assert.match(await textOf(page, "section.run [role=alert]"), /cancelled/i);
  assert.match(await page.locator("section.run [role=alert]").textContent(), /\bcancelled\b/); // the code
  await page.click("section.run button >> text=Dismiss");
  await page.locator("section.run").waitFor({ state: "detached" });
  const view = await api("GET", `/api/v1/conversations/${conversation}`, { key: ALICE });
  assert.equal(view.body.revision, 3);
});

let fork;

test("forks at a turn", async () => {
  await page.locator('article.turn[data-turn="1"] .fork').click();
  await page.waitForFunction((source) => location.hash.startsWith("#/conversations/") && !location.hash.includes(source), conversation);
  fork = page.url().split("#/conversations/")[1];
  assert.equal(await textOf(page, "#revision", /1/), "1");
  assert.equal(await page.locator("article.turn").count(), 1);
  assert.match(await page.locator("article.turn .message.user").textContent(), /hello/);
  assert.equal(await page.locator("article.turn .items tbody tr").count(), 3);
  const origin = await api("GET", `/api/v1/conversations/${fork}`, { key: ALICE });
  if ("forked_from" in origin.body) {
    // Where the server names a fork's origin, the console shows it, and the forks of the source.
    assert.match(await page.locator(".summary").textContent(), new RegExp(`Forked from${conversation} at revision 1`));
    await page.goto(`${BASE}/console/#/conversations/${conversation}`);
    await page.locator(`.forks a[href$="${fork}"]`).waitFor();
    await page.goto(`${BASE}/console/#/conversations/${fork}`);
    await textOf(page, "#revision", /1/);
  } else {
    assert.doesNotMatch(await page.locator(".summary").textContent(), /Forked from/);
  }
});

test("deletes with a confirmation, at the revision shown", async () => {
  await page.click("#delete");
  const dialog = page.locator("dialog#confirm");
  await dialog.waitFor();
  assert.match(await dialog.textContent(), new RegExp(`${fork} \\(revision 1\\)`));
  await page.click("dialog#confirm button[value=keep]");
  await dialog.waitFor({ state: "hidden" });
  assert.equal((await api("GET", `/api/v1/conversations/${fork}`, { key: ALICE })).status, 200);
  // A turn committed behind the page's back: the delete at the shown revision is refused.
  const behind = await api("POST", "/api/v1/chat", { key: ALICE, body: { message: "meanwhile", conversation_id: fork } });
  assert.equal(behind.body.revision, 2);
  await page.click("#delete");
  await page.click("#confirm-delete");
  assert.match(await textOf(page, "main > [role=alert]"), /revision/i);
  assert.equal((await api("GET", `/api/v1/conversations/${fork}`, { key: ALICE })).status, 200);
  await page.click("button >> text=Refresh");
  await textOf(page, "#revision", /2/);
  await page.click("#delete");
  await page.click("#confirm-delete");
  await page.waitForFunction(() => location.hash === "#/");
  await page.locator(`tr[data-id="${conversation}"]`).waitFor();
  assert.equal(await page.locator(`tr[data-id="${fork}"]`).count(), 0);
  assert.equal((await api("GET", `/api/v1/conversations/${fork}`, { key: ALICE })).status, 404);
});

test("another owner's conversation is not found, whatever form its id is typed in", async () => {
  for (const id of [BOB_CONVERSATION, `conv_${BOB_CONVERSATION.replaceAll("-", "")}`, "not-an-id"]) {
    await page.goto(`${BASE}/console/#/conversations/${id}`);
    await page.reload(); // a typed address: a fresh page
    assert.match(await textOf(page, "main [role=alert]"), /Conversation not found\.\s*conversation_not_found/);
    if (id === BOB_CONVERSATION) await shot(page, "not-found");
  }
});

test("signs out: the key leaves the tab", async () => {
  signedIn.to = seen.requests.length;
  await page.click("#sign-out");
  await page.locator("#key").waitFor();
  assert.equal(await page.evaluate(() => sessionStorage.length), 0);
});

test("the page asked nothing but its own origin's files and public API, with the key", async () => {
  assert.deepEqual(seen.problems, []);
  for (const { url } of seen.requests) assert.ok(url.startsWith(`${BASE}/`), url);
  const calls = seen.requests.slice(signedIn.from, signedIn.to).filter(({ url }) => /\/(api\/)?v1\//.test(url));
  assert.ok(calls.length > 20, calls.length);
  for (const { url, authorization } of calls) assert.equal(authorization, `Bearer ${ALICE}`, url);
  const paths = new Set(calls.map(({ url }) => new URL(url).pathname.split("/").slice(0, 4).join("/")));
  for (const prefix of paths) assert.match(prefix, /^\/(api\/v1\/(conversations|chat|turns|usage)|v1\/(conversations|responses))\b/);
});
