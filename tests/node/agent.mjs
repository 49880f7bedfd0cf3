// The openai npm package driving TurnRL's live endpoint as its README shows: a tool-calling
// loop on chat completions (plain, then streamed with usage) and on the Responses API
// (previous_response_id, then streamed). Prints what each session was served, as JSON, for
// tests/test_frameworks.py to check against the run's records.
//   node agent.mjs <base URL> <key> <question> <tool result>
import OpenAI from "openai";

const [baseURL, apiKey, question, result] = process.argv.slice(2);
const model = "turnrl-policy";
const search = { name: "search", description: "Search the documents.",
  parameters: { type: "object", properties: { query: { type: "string" } }, required: ["query"] } };
const client = (sid) => new OpenAI({ baseURL, apiKey, maxRetries: 0, defaultHeaders: { "X-Session-Id": sid } });

async function chat(sid, stream) {
  const openai = client(sid);
  const tools = [{ type: "function", function: search }];
  const messages = [{ role: "user", content: question }];
  const first = await openai.chat.completions.create({ model, messages, tools, temperature: 0 });
  const message = first.choices[0].message;
  messages.push(message);
  for (const call of message.tool_calls ?? []) messages.push({ role: "tool", tool_call_id: call.id, content: result });
  const calls = (message.tool_calls ?? []).map((c) => [c.function.name, c.function.arguments]);
  if (!stream) {
    const second = await openai.chat.completions.create({ model, messages, tools, temperature: 0 });
    return { calls, answer: second.choices[0].message.content, finish: first.choices[0].finish_reason };
  }
  const chunks = await openai.chat.completions.create({ model, messages, tools, temperature: 0, stream: true,
    stream_options: { include_usage: true } });
  let answer = "", usage = null;
  for await (const chunk of chunks) {
    if (chunk.choices.length) answer += chunk.choices[0].delta.content ?? "";
    if (chunk.usage) usage = chunk.usage;
  }
  return { calls, answer, finish: first.choices[0].finish_reason, completion_tokens: usage?.completion_tokens };
}

async function responses(sid, stream) {
  const openai = client(sid);
  const tools = [{ type: "function", ...search, strict: false }];
  const first = await openai.responses.create({ model, input: question, tools, temperature: 0 });
  const call = first.output.find((o) => o.type === "function_call");
  const input = [{ type: "function_call_output", call_id: call.call_id, output: result }];
  const next = { model, previous_response_id: first.id, input, tools, temperature: 0 };
  if (!stream) {
    const second = await openai.responses.create(next);
    return { calls: [[call.name, call.arguments]], answer: second.output_text, status: second.status };
  }
  let answer = "", last = null;
  for await (const event of await openai.responses.create({ ...next, stream: true })) {
    if (event.type === "response.output_text.delta") answer += event.delta;
    last = event;
  }
  return { calls: [[call.name, call.arguments]], answer, status: last.response.status,
    final: last.response.output.filter((o) => o.type === "message").flatMap((o) => o.content).map((c) => c.text).join("") };
}

const out = {
  "node-chat": await chat("node-chat", false), "node-chat-stream": await chat("node-chat-stream", true),
  "node-responses": await responses("node-responses", false),
  "node-responses-stream": await responses("node-responses-stream", true),
};
console.log(JSON.stringify(out));
