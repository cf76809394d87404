// The openai npm package's helpers against turnstore's /v1, as its documentation shows them:
// responses.parse with a zod schema (zodTextFormat), responses.stream with fields the
// provider gets as they came, models.list. tests/test_v1_clients_js.py serves turnstore over
// the fake Responses API (fake.mjs), with MODELS=gpt-other besides the configured gpt-test.
import assert from "node:assert/strict";
import test from "node:test";
import OpenAI from "openai";
import { zodTextFormat } from "openai/helpers/zod";
import { z } from "zod";
import { BASE_URL, CALL_USAGE, answers, pick, received } from "./fake.mjs";

const client = new OpenAI({ baseURL: BASE_URL, apiKey: "unused", maxRetries: 0 });

const City = z.object({ name: z.string(), population: z.number().int() });

test("responses.parse with zodTextFormat, in a conversation", async () => {
  const city = { name: "Paris", population: 2100000 };
  await answers({ text: JSON.stringify(city) });
  const conversation = await client.conversations.create();
  const fields = { temperature: 0.1, top_p: 0.8, service_tier: "flex", user: "u-parse" };
  const response = await client.responses.parse({
    model: "gpt-test",
    conversation: conversation.id,
    input: [
      { role: "system", content: "Answer with a city." },
      { role: "user", content: "The capital of France?" },
    ],
    text: { format: zodTextFormat(City, "city") },
    ...fields,
  });
  assert.deepEqual(response.output_parsed, city);
  const [sent] = await received();
  assert.deepEqual(pick(sent, Object.keys(fields)), fields);
  assert.deepEqual(
    pick(sent.text.format, ["type", "name", "strict"]),
    { type: "json_schema", name: "city", strict: true },
  );
  assert.deepEqual(response.text.format, sent.text.format); // echoed as sent
  assert.deepEqual(pick(response, Object.keys(fields)), fields);
  assert.deepEqual(
    [response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens],
    [CALL_USAGE.input, CALL_USAGE.output, CALL_USAGE.total],
  );
});

test("responses.stream forwards what it was given and echoes it", async () => {
  await answers({ text: "streamed", deltas: 3 });
  const conversation = await client.conversations.create();
  const fields = {
    stream_options: { include_obfuscation: false },
    reasoning: { effort: "low", summary: "auto" },
    top_logprobs: 2,
    max_output_tokens: 64,
    tool_choice: "none",
    prompt_cache_key: "k-stream",
    metadata: { run: "stream" },
  };
  const stream = client.responses.stream({
    model: "gpt-test",
    conversation: conversation.id,
    input: "go",
    include: ["message.output_text.logprobs"],
    ...fields,
  });
  let text = "";
  stream.on("response.output_text.delta", (event) => {
    text += event.delta;
  });
  const final = await stream.finalResponse();
  assert.equal(text, "streamed");
  assert.equal(final.output_text, "streamed");
  const [sent] = await received();
  assert.deepEqual(pick(sent, Object.keys(fields)), fields);
  assert.ok(sent.include.includes("message.output_text.logprobs"));
  const echoed = ["reasoning", "max_output_tokens", "tool_choice", "prompt_cache_key", "metadata"];
  assert.deepEqual(pick(final, echoed), pick(fields, echoed));
  assert.equal(final.usage.total_tokens, CALL_USAGE.total);
});

test("models.list names the models a request may use", async () => {
  await answers({ text: "from the other model" });
  const listed = [];
  for await (const model of client.models.list()) listed.push(model.id);
  assert.deepEqual(listed, ["gpt-test", "gpt-other"]);
  assert.equal((await client.models.retrieve("gpt-other")).id, "gpt-other");
  await assert.rejects(client.models.retrieve("gpt-unknown"), OpenAI.NotFoundError);
  const conversation = await client.conversations.create();
  const response = await client.responses.create({
    model: "gpt-other",
    conversation: conversation.id,
    input: "hi",
  });
  assert.equal(response.model, "gpt-other");
  assert.equal((await received())[0].model, "gpt-other");
  await assert.rejects(
    client.responses.create({ model: "gpt-unknown", conversation: conversation.id, input: "x" }),
    (error) =>
      error instanceof OpenAI.BadRequestError &&
      error.code === "model_not_found" &&
      error.param === "model",
  );
});
