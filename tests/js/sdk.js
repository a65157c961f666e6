// The entry point esbuild bundles into one browser file: the official SDK, as a page imports it.
export { default as OpenAI } from "openai";
