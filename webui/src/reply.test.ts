import { describe, expect, it } from "vitest";
import { ReplyBuilder, StreamError } from "./reply";

describe("ReplyBuilder", () => {
  it("assembles text, reasoning, tool calls and figures from chunks", () => {
    const reply = new ReplyBuilder(1000);
    reply.add({ choices: [{ delta: { role: "assistant", content: "" } }] }, 1100);
    reply.add({ choices: [{ delta: { reasoning_content: "Think." } }] }, 1250);
    reply.add({ choices: [{ delta: { content: "Hel" } }] }, 1300);
    reply.add({ choices: [{ delta: { content: "lo" } }] }, 1350);
    reply.add({ choices: [{ delta: { tool_calls: [{ index: 0, id: "call_1", function: { name: "f", arguments: '{"x"' } }] } }] }, 1400);
    reply.add({ choices: [{ delta: { tool_calls: [{ index: 0, function: { arguments: ": 1}" } }] }, finish_reason: "tool_calls" }] }, 1450);
    expect(reply.figures()).toBeNull();
    reply.add(
      {
        choices: [],
        usage: { prompt_tokens: 40, completion_tokens: 5, prompt_tokens_details: { cached_tokens: 32 } },
        timings: { predicted_per_second: 50, prompt_ms: 12 },
      },
      1500,
    );
    expect(reply.message()).toEqual({
      role: "assistant",
      content: "Hello",
      reasoning_content: "Think.",
      tool_calls: [{ id: "call_1", type: "function", function: { name: "f", arguments: '{"x": 1}' } }],
    });
    expect(reply.finishReason).toBe("tool_calls");
    expect(reply.figures()).toEqual({
      tokensPerSecond: 50,
      ttftMs: 250,
      promptTokens: 40,
      cachedTokens: 32,
      completionTokens: 5,
      draftedTokens: 0,
    });
  });

  it("counts the generated tokens that came from verified drafts", () => {
    const reply = new ReplyBuilder(0);
    reply.add({ choices: [{ delta: { content: "Hello again" }, finish_reason: "stop" }] }, 10);
    reply.add(
      {
        choices: [],
        usage: { prompt_tokens: 9, completion_tokens: 12 },
        timings: { predicted_per_second: 80, prompt_ms: 5, draft_n_accepted: 7 },
      },
      20,
    );
    expect(reply.figures()?.draftedTokens).toBe(7);
  });

  it("throws the error a stream carries", () => {
    const reply = new ReplyBuilder(0);
    expect(() => reply.add({ error: { message: "too long", code: "context_length_exceeded" } }, 1)).toThrow(StreamError);
  });
});
