// The Vercel AI SDK (ai + @ai-sdk/openai) against turnstore's /v1, as its documentation shows
// it: generateText / streamText with a system prompt and a tool the SDK runs itself, and
// generateObject, in a conversation (providerOptions.openai.conversation).
// tests/test_v1_clients_js.py serves turnstore over the fake Responses API (fake.mjs).
import assert from "node:assert/strict";
import test from "node:test";
import OpenAI from "openai";
import { createOpenAI } from "@ai-sdk/openai";
import { generateObject, generateText, stepCountIs, streamText, tool } from "ai";
import { z } from "zod";
import { BASE_URL, CALL_USAGE, answers, kinds, pick, received } from "./fake.mjs";

const client = new OpenAI({ baseURL: BASE_URL, apiKey: "unused", maxRetries: 0 });
const openai = createOpenAI({ baseURL: BASE_URL, apiKey: "unused" });

const ran = [];
const weather = tool({
  description: "Weather in a city.",
  inputSchema: z.object({ city: z.string() }),
  execute: async ({ city }) => {
    ran.push(city);
    return `sunny in ${city}`;
  },
});

// Call settings and provider options, and the request fields they become (echoed back).
const options = (conversation) => ({
  temperature: 0.2,
  maxOutputTokens: 40,
  maxRetries: 0,
  providerOptions: {
    openai: {
      conversation,
      metadata: { run: "ai" },
      user: "u-ai",
      safetyIdentifier: "s-ai",
      parallelToolCalls: false,
      promptCacheKey: "k-ai",
      promptCacheRetention: "24h",
      maxToolCalls: 3,
      textVerbosity: "low",
    },
  },
});
const SENT = {
  temperature: 0.2,
  max_output_tokens: 40,
  metadata: { run: "ai" },
  user: "u-ai",
  safety_identifier: "s-ai",
  parallel_tool_calls: false,
  prompt_cache_key: "k-ai",
  prompt_cache_retention: "24h",
  max_tool_calls: 3,
  text: { verbosity: "low" },
};
const FIELDS = Object.keys(SENT);
const ECHOED = FIELDS.filter((name) => !["prompt_cache_retention", "max_tool_calls"].includes(name));

const callWeather = (city) => ({ calls: [["weather", JSON.stringify({ city })]] });

// What each step of a tool loop in a conversation sends: the first step the system prompt
// and the question; the second, turnstore's history then what the SDK sends again (the system
// prompt, the question: it drops only items with an id) and the tool's output.
function checkToolSteps(first, second, city) {
  for (const sent of [first, second]) {
    assert.deepEqual(pick(sent, FIELDS), SENT);
    assert.equal(sent.tool_choice, "auto");
    assert.deepEqual(sent.tools.map((t) => t.name), ["weather"]);
  }
  assert.deepEqual(first.input[0], { role: "system", content: "Be terse." });
  assert.deepEqual(kinds(second), [
    "message", "message", "reasoning", "function_call", "message", "message",
    "function_call_output",
  ]);
  assert.deepEqual(second.input.at(-1).output, `sunny in ${city}`);
}

test("generateText with a system prompt and a tool, in a conversation", async () => {
  ran.length = 0;
  await answers(callWeather("Paris"), { text: "Sunny in Paris." });
  const conversation = await client.conversations.create();
  const result = await generateText({
    model: openai.responses("gpt-test"),
    system: "Be terse.",
    prompt: "weather in Paris?",
    tools: { weather },
    stopWhen: stepCountIs(3),
    include: { responseBody: true }, // ai 7 keeps a step's response body only when asked
    ...options(conversation.id),
  });
  assert.deepEqual(ran, ["Paris"]);
  assert.equal(result.text, "Sunny in Paris.");
  assert.equal(result.steps.length, 2);
  const [first, second] = await received();
  checkToolSteps(first, second, "Paris");
  for (const step of result.steps) {
    assert.deepEqual(pick(step.response.body, ECHOED), pick(SENT, ECHOED));
    assert.equal(step.usage.totalTokens, CALL_USAGE.total);
  }
  assert.deepEqual(
    [result.totalUsage.inputTokens, result.totalUsage.outputTokens, result.totalUsage.totalTokens],
    [2 * CALL_USAGE.input, 2 * CALL_USAGE.output, 2 * CALL_USAGE.total],
  );
  // The conversation keeps what each step sent: the system prompt and the question twice
  // (as OpenAI would keep them: the SDK sends them again).
  const items = [];
  for await (const item of client.conversations.items.list(conversation.id, { order: "asc" })) {
    items.push(item.role ?? item.type);
  }
  assert.deepEqual(items, [
    "system", "user", "reasoning", "function_call", "system", "user", "function_call_output",
    "reasoning", "assistant",
  ]);
});

test("streamText with a system prompt and a tool, in a conversation", async () => {
  ran.length = 0;
  await answers(callWeather("Oslo"), { text: "Sunny in Oslo.", deltas: 3 });
  const conversation = await client.conversations.create();
  const result = streamText({
    model: openai.responses("gpt-test"),
    system: "Be terse.",
    prompt: "weather in Oslo?",
    tools: { weather },
    stopWhen: stepCountIs(3),
    includeRawChunks: true,
    ...options(conversation.id),
  });
  const completed = [];
  let text = "";
  for await (const part of result.fullStream) {
    if (part.type === "text-delta") text += part.text;
    if (part.type === "raw" && part.rawValue.type === "response.completed") {
      completed.push(part.rawValue.response);
    }
    if (part.type === "error") throw part.error;
  }
  assert.deepEqual(ran, ["Oslo"]);
  assert.equal(text, "Sunny in Oslo.");
  assert.equal(await result.text, "Sunny in Oslo.");
  const [first, second] = await received();
  assert.ok(first.stream && second.stream);
  checkToolSteps(first, second, "Oslo");
  assert.equal(completed.length, 2);
  for (const response of completed) {
    assert.deepEqual(pick(response, ECHOED), pick(SENT, ECHOED));
  }
  assert.equal((await result.totalUsage).totalTokens, 2 * CALL_USAGE.total);
});

test("generateObject in a conversation", async () => {
  const city = { name: "Paris", population: 2100000 };
  await answers({ text: JSON.stringify(city) });
  const conversation = await client.conversations.create();
  const result = await generateObject({
    model: openai.responses("gpt-test"),
    schema: z.object({ name: z.string(), population: z.number().int() }),
    system: "Answer with a city.",
    prompt: "The capital of France?",
    maxRetries: 0,
    providerOptions: { openai: { conversation: conversation.id } },
  });
  assert.deepEqual(result.object, city);
  const [sent] = await received();
  assert.equal(sent.text.format.type, "json_schema");
  assert.equal(sent.text.format.strict, true);
  assert.deepEqual(Object.keys(sent.text.format.schema.properties), ["name", "population"]);
  assert.deepEqual(result.response.body.text, sent.text); // echoed
  assert.equal(result.usage.totalTokens, CALL_USAGE.total);
});

test("generateText with a tool and store: false, without a conversation", async () => {
  ran.length = 0;
  await answers(callWeather("Lima"), { text: "Sunny in Lima." });
  const result = await generateText({
    model: openai.responses("gpt-test"),
    system: "Be terse.",
    prompt: "weather in Lima?",
    tools: { weather },
    stopWhen: stepCountIs(3),
    maxRetries: 0,
    providerOptions: { openai: { store: false } },
  });
  assert.deepEqual(ran, ["Lima"]);
  assert.equal(result.text, "Sunny in Lima.");
  // The SDK keeps the history: the second step sends the sealed reasoning it got back.
  const [, second] = await received();
  assert.deepEqual(kinds(second), [
    "message", "message", "reasoning", "function_call", "function_call_output",
  ]);
  assert.match(second.input[2].encrypted_content, /^gAAA-sealed-\d+==$/);
  assert.equal(result.totalUsage.totalTokens, 2 * CALL_USAGE.total);
});

// Without a conversation and with OpenAI's default store (true): each step is a stored
// response, and the next step names the earlier step's output by id (item_reference), which
// turnstore restores to the stored bytes.
test("generateText with a tool without a conversation (stored responses)", async () => {
  ran.length = 0;
  await answers(callWeather("Lima"), { text: "Sunny in Lima." });
  const result = await generateText({
    model: openai.responses("gpt-test"),
    prompt: "weather in Lima?",
    tools: { weather },
    stopWhen: stepCountIs(3),
    maxRetries: 0,
  });
  assert.deepEqual(ran, ["Lima"]);
  assert.equal(result.text, "Sunny in Lima.");
  const [first, second] = await received();
  const sealed = first.input.length; // the provider got its own reasoning back, whole
  assert.equal(second.input[sealed].type, "reasoning");
  assert.match(second.input[sealed].encrypted_content, /^gAAA-sealed-\d+==$/);
  assert.equal(second.input.at(-1).type, "function_call_output");
});

test("streamText without a conversation", async () => {
  await answers({ text: "streamed" });
  const result = streamText({ model: openai.responses("gpt-test"), prompt: "hi", maxRetries: 0 });
  const errors = [];
  for await (const part of result.fullStream) if (part.type === "error") errors.push(part.error);
  assert.deepEqual(errors, []);
  assert.equal(await result.text, "streamed");
  const body = (await result.response).body;
  assert.equal(body?.store ?? true, true);
});

// The tool loop of streamText with store: false keeps the history itself: it needs the
// reasoning item announced in the stream (output_item.added / .done at output_index 0, before
// the function call at 1) to send it back with the call; a reasoning model refuses a call
// without the reasoning that made it.
test("streamText with a tool and store: false sends the streamed reasoning back", async () => {
  ran.length = 0;
  await answers(callWeather("Rome"), { text: "Sunny in Rome." });
  const result = streamText({
    model: openai.responses("gpt-test"),
    prompt: "weather in Rome?",
    tools: { weather },
    stopWhen: stepCountIs(3),
    maxRetries: 0,
    includeRawChunks: true,
    providerOptions: { openai: { store: false, include: ["reasoning.encrypted_content"] } },
  });
  const added = [];
  const reasoning = [];
  for await (const part of result.fullStream) {
    if (part.type === "error") throw part.error;
    if (part.type === "raw" && part.rawValue.type === "response.output_item.added") {
      added.push([part.rawValue.output_index, part.rawValue.item.type]);
    }
    if (part.type === "reasoning-start") reasoning.push(part.id);
  }
  assert.deepEqual(ran, ["Rome"]);
  assert.equal(await result.text, "Sunny in Rome.");
  assert.deepEqual(added.slice(0, 2), [[0, "reasoning"], [1, "function_call"]]);
  assert.equal(reasoning.length, 2); // one reasoning item a step, as the stream announced it
  const [first, second] = await received();
  assert.deepEqual(kinds(second), ["message", "reasoning", "function_call", "function_call_output"]);
  // The provider got its own reasoning back, as it made it: its id, its sealed content.
  assert.equal(first.input.length, 1);
  assert.match(second.input[1].id, /^rs_[0-9a-f]{48}$/);
  assert.match(second.input[1].encrypted_content, /^gAAA-sealed-\d+==$/);
});

// ai 7 reads the compaction item a Response's output holds (OpenAI's shape): generateText
// in a conversation that compacts works.
test("generateText in a conversation that compacts", async () => {
  await answers({ text: "one" }, {}, { text: "two" });
  const conversation = await client.conversations.create();
  const compacting = (prompt) =>
    generateText({
      model: openai.responses("gpt-test"),
      prompt,
      maxRetries: 0,
      providerOptions: {
        openai: {
          conversation: conversation.id,
          contextManagement: [{ type: "compaction", compactThreshold: 1 }],
        },
      },
    });
  assert.equal((await compacting("first")).text, "one");
  const second = await compacting("second");
  assert.equal(second.text, "two");
  const sent = await received();
  assert.ok(sent.some((request) => request.input.some((item) => item.type === "compaction")));
});
