// The official openai npm package as turnstore's client: TURNSTORE_URL is a served app
// (tests/test_openai_js.py starts it). One conversation round trip, one streamed turn.
import assert from "node:assert/strict";
import test from "node:test";
import OpenAI from "openai";

const client = new OpenAI({
  baseURL: `${process.env.TURNSTORE_URL}/v1`,
  apiKey: "unused",
  maxRetries: 0,
});

test("a conversation round trip", async () => {
  const made = await client.conversations.create({ metadata: { topic: "js" } });
  assert.match(made.id, /^conv_/);
  const got = await client.conversations.retrieve(made.id);
  assert.deepEqual(got.metadata, { topic: "js" });
  const response = await client.responses.create({ conversation: made.id, input: "ping" });
  assert.equal(response.output_text, "[fake-llm] ping");
  const items = [];
  for await (const item of client.conversations.items.list(made.id, { order: "asc", limit: 1 })) {
    items.push(item);
  }
  assert.deepEqual(items.map((item) => item.type), ["message", "reasoning", "message"]);
  const deleted = await client.conversations.delete(made.id);
  assert.equal(deleted.deleted, true);
  await assert.rejects(client.conversations.retrieve(made.id), OpenAI.NotFoundError);
});

test("a streamed turn", async () => {
  const conversation = await client.conversations.create();
  const stream = client.responses.stream({
    conversation: conversation.id,
    input: "stream it",
    model: "fake-llm",
  });
  let text = "";
  stream.on("response.output_text.delta", (event) => {
    text += event.delta;
  });
  const final = await stream.finalResponse();
  assert.equal(text, "[fake-llm] stream it");
  assert.equal(final.output_text, text);
  const again = await client.responses.retrieve(final.id);
  assert.equal(again.output_text, text);
});

test("an error event raises", async () => {
  await assert.rejects(
    client.responses.create({ conversation: "conv_" + "0".repeat(32), input: "x" }),
    (error) => error instanceof OpenAI.NotFoundError && error.code === "conversation_not_found",
  );
});
