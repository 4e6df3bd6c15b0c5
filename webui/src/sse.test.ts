import { describe, expect, it } from "vitest";
import { SSEParser, jsonEvents } from "./sse";

describe("SSEParser", () => {
  it("joins data lines, names events, skips comments and splits on every line ending", () => {
    const parser = new SSEParser();
    const text = ": ping\n\ndata: {\"a\":\ndata: 1}\n\nevent: delta\r\ndata: x\r\n\r\ndata:y\rdata: z\r\r";
    expect(parser.feed(text)).toEqual([
      { event: "message", data: '{"a":\n1}' },
      { event: "delta", data: "x" },
      { event: "message", data: "y\nz" },
    ]);
  });

  it("gives the same events however the text is cut", () => {
    const text = 'data: {"choices": [{"delta": {"content": "é 🙂"}}]}\r\n\r\ndata: [DONE]\r\n\r\n';
    const whole = new SSEParser().feed(text);
    for (let size = 1; size < 8; size++) {
      const parser = new SSEParser();
      const events = [];
      for (let i = 0; i < text.length; i += size) events.push(...parser.feed(text.slice(i, i + size)));
      expect(events).toEqual(whole);
    }
    expect(whole.map((event) => event.data)).toEqual(['{"choices": [{"delta": {"content": "é 🙂"}}]}', "[DONE]"]);
  });

  it("keeps an event without its blank line until the line comes", () => {
    const parser = new SSEParser();
    expect(parser.feed("data: partial\n")).toEqual([]);
    expect(parser.feed("\n")).toEqual([{ event: "message", data: "partial" }]);
  });
});

describe("jsonEvents", () => {
  it("decodes a body whose bytes split characters, and stops at [DONE]", async () => {
    const bytes = new TextEncoder().encode('data: {"t": "ü€"}\n\ndata: [DONE]\n\ndata: {"t": "after"}\n\n');
    const body = new ReadableStream<Uint8Array>({
      start(controller) {
        for (const byte of bytes) controller.enqueue(new Uint8Array([byte]));
        controller.close();
      },
    });
    const seen = [];
    for await (const event of jsonEvents(body)) seen.push(event);
    expect(seen).toEqual([{ t: "ü€" }]);
  });
});
