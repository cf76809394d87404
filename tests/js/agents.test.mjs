// The OpenAI Agents SDK for JavaScript (@openai/agents) against turnstore's /v1, as its
// documentation shows it: an agent with instructions, model settings and a function tool the
// SDK runs itself, over a server-managed conversation (conversationId) and over
// OpenAIConversationsSession, run and streamed. tests/test_v1_clients_js.py serves turnstore
// over the fake Responses API (fake.mjs).
import assert from "node:assert/strict";
import test from "node:test";
import OpenAI from "openai";
import {
  Agent,
  OpenAIConversationsSession,
  run,
  setDefaultOpenAIClient,
  setTracingDisabled,
  tool,
} from "@openai/agents";
import { z } from "zod";
import { BASE_URL, CALL_USAGE, answers, kinds, pick, received } from "./fake.mjs";

const client = new OpenAI({ baseURL: BASE_URL, apiKey: "unused", maxRetries: 0 });
setDefaultOpenAIClient(client);
setTracingDisabled(true);

const ran = [];
const getWeather = tool({
  name: "get_weather",
  description: "Weather in a city.",
  parameters: z.object({ city: z.string() }),
  execute: async ({ city }) => {
    ran.push(city);
    return `sunny in ${city}`;
  },
});

const modelSettings = {
  temperature: 0.3,
  topP: 0.9,
  maxTokens: 50,
  toolChoice: "auto",
  parallelToolCalls: false,
  reasoning: { effort: "low" },
  text: { verbosity: "low" },
  providerData: {
    metadata: { run: "js" },
    user: "u-js",
    safety_identifier: "s-js",
    service_tier: "flex",
    prompt_cache_key: "k-js",
  },
};
// The request fields they become, which every Response echoes.
const SENT = {
  temperature: 0.3,
  top_p: 0.9,
  max_output_tokens: 50,
  tool_choice: "auto",
  parallel_tool_calls: false,
  reasoning: { effort: "low" },
  text: { verbosity: "low" },
  metadata: { run: "js" },
  user: "u-js",
  safety_identifier: "s-js",
  service_tier: "flex",
  prompt_cache_key: "k-js",
};
const FIELDS = Object.keys(SENT);

const forecaster = (settings = modelSettings) =>
  new Agent({
    name: "forecaster",
    instructions: "Be terse.",
    model: "gpt-test",
    modelSettings: settings,
    tools: [getWeather],
  });

const callWeather = (city) => ({ calls: [["get_weather", JSON.stringify({ city })]] });

test("an agent over a conversation runs its tool and forwards its settings", async () => {
  ran.length = 0;
  await answers(callWeather("Paris"), { text: "Sunny in Paris." });
  const conversation = await client.conversations.create();
  const result = await run(forecaster(), "weather in Paris?", { conversationId: conversation.id });
  assert.deepEqual(ran, ["Paris"]);
  assert.equal(result.finalOutput, "Sunny in Paris.");
  const [first, second] = await received();
  assert.deepEqual(pick(first, FIELDS), SENT);
  // The SDK drops toolChoice once a tool ran (resetToolChoice), the rest stays.
  assert.deepEqual(pick(second, FIELDS), { ...SENT, tool_choice: undefined });
  for (const sent of [first, second]) {
    assert.equal(sent.instructions, "Be terse.");
    assert.deepEqual(sent.tools.map((t) => t.name), ["get_weather"]);
  }
  // The follow-up sent only the tool's output: turnstore put the call back before it.
  assert.deepEqual(kinds(second), ["message", "reasoning", "function_call", "function_call_output"]);
  assert.equal(second.input.at(-1).output, "sunny in Paris");
  // Each Response echoes what was sent (OpenAI's default tool_choice where it was silent),
  // and its usage is the provider's.
  for (const raw of result.rawResponses) {
    assert.deepEqual(pick(raw.providerData, FIELDS), SENT);
    assert.equal(raw.providerData.instructions, "Be terse.");
    assert.equal(raw.usage.totalTokens, CALL_USAGE.total);
  }
  const usage = result.state.usage;
  assert.deepEqual(
    [usage.requests, usage.inputTokens, usage.outputTokens, usage.totalTokens],
    [2, 2 * CALL_USAGE.input, 2 * CALL_USAGE.output, 2 * CALL_USAGE.total],
  );
});

test("a streamed agent run sees its text, its settings echoed and the provider's usage", async () => {
  ran.length = 0;
  await answers(callWeather("Oslo"), { text: "Sunny in Oslo.", deltas: 3 });
  const conversation = await client.conversations.create();
  const stream = await run(forecaster(), "weather in Oslo?", {
    conversationId: conversation.id,
    stream: true,
  });
  let text = "";
  const done = [];
  for await (const event of stream) {
    if (event.type !== "raw_model_stream_event") continue;
    if (event.data.type === "output_text_delta") text += event.data.delta;
    if (event.data.type === "response_done") done.push(event.data.response);
  }
  await stream.completed;
  assert.deepEqual(ran, ["Oslo"]);
  assert.equal(stream.finalOutput, "Sunny in Oslo.");
  assert.equal(text, "Sunny in Oslo.");
  assert.ok((await received()).every((request) => request.stream === true));
  assert.equal(done.length, 2);
  for (const response of done) {
    assert.deepEqual(pick(response.providerData, FIELDS), SENT);
    assert.equal(response.usage.totalTokens, CALL_USAGE.total);
  }
  assert.equal(stream.state.usage.totalTokens, 2 * CALL_USAGE.total);
});

test("an agent over a conversations session keeps its tool turns", async () => {
  ran.length = 0;
  await answers(callWeather("Rome"), { text: "Sunny in Rome." }, { text: "Warm tomorrow." });
  const conversation = await client.conversations.create();
  const session = new OpenAIConversationsSession({ conversationId: conversation.id, client });
  const agent = forecaster({ temperature: 0.3, maxTokens: 50 });
  const first = await run(agent, "weather in Rome?", { session });
  const second = await run(agent, "and tomorrow?", { session });
  assert.deepEqual(ran, ["Rome"]);
  assert.deepEqual([first.finalOutput, second.finalOutput], ["Sunny in Rome.", "Warm tomorrow."]);
  const requests = await received();
  assert.equal(requests.length, 3);
  const last = requests[2];
  // The session sends the whole history itself (no conversation on the call): the tool call
  // and its output appended together are part of it, and turnstore put back the sealed
  // reasoning the listing showed without its encrypted_content.
  assert.deepEqual(kinds(last), [
    "message", "reasoning", "function_call", "function_call_output", "reasoning", "message",
    "message",
  ]);
  for (const item of last.input.filter((i) => i.type === "reasoning")) {
    assert.match(item.encrypted_content, /^gAAA-sealed-\d+==$/);
  }
  assert.equal(last.temperature, 0.3);
  assert.equal(second.state.usage.totalTokens, CALL_USAGE.total);
});

test("a streamed run over a conversations session", async () => {
  // The session's calls carry no conversation: each streams a stored response whose input is
  // the history the session listed.
  await answers({ text: "streamed" });
  const conversation = await client.conversations.create();
  const session = new OpenAIConversationsSession({ conversationId: conversation.id, client });
  const agent = new Agent({ name: "a", instructions: "Be terse.", model: "gpt-test" });
  const stream = await run(agent, "one", { session, stream: true });
  for await (const _ of stream) {
    // drain
  }
  await stream.completed;
  assert.equal(stream.finalOutput, "streamed");
  const kept = await session.getItems();
  assert.deepEqual(
    kept.map((item) => [item.type ?? "message", item.role]),
    [["message", "user"], ["reasoning", undefined], ["message", "assistant"]],
  );
});

// A handoff between agents on two models, with store: false (the SDK keeps the history): the
// first model's sealed reasoning is in the history the second agent sends; turnstore leaves it
// out (a reasoning model refuses another model's), the call and its output stay.
test("a handoff between agents on two models with store: false", async () => {
  await answers({ calls: [["transfer_to_specialist", "{}"]] }, { text: "Specialist here." });
  const specialist = new Agent({ name: "specialist", model: "gpt-other", modelSettings: { store: false } });
  const triage = new Agent({
    name: "triage",
    model: "gpt-test",
    handoffs: [specialist],
    modelSettings: { store: false },
  });
  const result = await run(triage, "a question");
  assert.equal(result.finalOutput, "Specialist here.");
  assert.equal(result.lastAgent.name, "specialist");
  const [first, second] = await received();
  assert.deepEqual([first.model, second.model], ["gpt-test", "gpt-other"]);
  assert.deepEqual(kinds(second), ["message", "function_call", "function_call_output"]);
});
