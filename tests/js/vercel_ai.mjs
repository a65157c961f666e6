// The Vercel AI SDK's default OpenAI provider (createOpenAI: the Responses API) against greenserve,
// for tests/test_responses_js.py. Reads {baseURL, apiKey, model, prompt, maxOutputTokens, seed} as JSON
// on stdin and prints one JSON object: a generateText answer, the same request streamed with
// streamText, and a two-step tool loop (a required call of get_weather, its result, the answer).
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, jsonSchema, stepCountIs, streamText, tool } from "ai";

const input = JSON.parse(await new Promise((resolve) => {
  let text = "";
  process.stdin.on("data", (chunk) => (text += chunk));
  process.stdin.on("end", () => resolve(text));
}));
const openai = createOpenAI({ baseURL: input.baseURL, apiKey: input.apiKey });
const ask = {
  model: openai(input.model),
  prompt: input.prompt,
  temperature: 0,
  maxOutputTokens: input.maxOutputTokens,
  maxRetries: 0,
};

const made = await generateText(ask);
const streamed = streamText(ask);
let deltas = "";
for await (const text of streamed.textStream) deltas += text;

const asked = [];
const looped = await generateText({
  ...ask,
  prompt: "What is the weather in Paris?",
  tools: {
    get_weather: tool({
      description: "The current weather in a city.",
      inputSchema: jsonSchema({
        type: "object",
        properties: { city: { type: "string", maxLength: 12 } },
        required: ["city"],
        additionalProperties: false,
      }),
      execute: async ({ city }) => {
        asked.push(city);
        return `Sunny and 22 C in ${city}.`;
      },
    }),
  },
  // The first step must call; prepareStep lets the second answer in text.
  prepareStep: ({ stepNumber }) => ({ toolChoice: stepNumber === 0 ? "required" : "none" }),
  stopWhen: stepCountIs(2),
});

console.log(JSON.stringify({
  made: {
    text: made.text,
    finishReason: made.finishReason,
    usage: made.usage,
    id: made.response.id,
  },
  streamed: {
    text: await streamed.text,
    deltas,
    finishReason: await streamed.finishReason,
    id: (await streamed.response).id,
  },
  loop: {
    asked,
    steps: looped.steps.map((s) => ({
      finishReason: s.finishReason,
      toolCalls: s.toolCalls.map((c) => ({ name: c.toolName, input: c.input, id: c.toolCallId })),
      text: s.text,
    })),
    text: looped.text,
  },
}));
