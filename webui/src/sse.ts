// Server-sent events: a parser fed the response body piece by piece, and the reader of a chat completion stream.

/** One event of an SSE stream: its type (`message` unless named) and its data lines joined by newlines. */
export interface SSEEvent {
  event: string;
  data: string;
}

/** Splits an SSE byte stream, decoded to text in arbitrary pieces, into events (comments and ids are dropped). */
export class SSEParser {
  private buffer = "";
  private data: string[] = [];
  private event = "";
  private pendingCR = false;

  /** The events completed by this piece of text. */
  feed(text: string): SSEEvent[] {
    if (this.pendingCR && text.startsWith("\n")) text = text.slice(1); // a CRLF split between two pieces
    this.pendingCR = false;
    this.buffer += text;
    const events: SSEEvent[] = [];
    for (;;) {
      const match = /\r\n|\r|\n/.exec(this.buffer);
      if (match === null) break;
      if (match[0] === "\r" && match.index === this.buffer.length - 1) this.pendingCR = true;
      const line = this.buffer.slice(0, match.index);
      this.buffer = this.buffer.slice(match.index + match[0].length);
      const event = this.line(line);
      if (event !== null) events.push(event);
    }
    return events;
  }

  private line(line: string): SSEEvent | null {
    if (line === "") {
      if (this.data.length === 0) return null;
      const event = { event: this.event || "message", data: this.data.join("\n") };
      this.data = [];
      this.event = "";
      return event;
    }
    if (line.startsWith(":")) return null;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "data") this.data.push(value);
    else if (field === "event") this.event = value;
    return null;
  }
}

/** The JSON objects of an SSE body up to `data: [DONE]`, as they arrive. */
export async function* jsonEvents(body: ReadableStream<Uint8Array>): AsyncGenerator<unknown> {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  const parser = new SSEParser();
  try {
    for (;;) {
      const { done, value } = await reader.read();
      if (done) return;
      for (const event of parser.feed(decoder.decode(value, { stream: true }))) {
        if (event.data === "[DONE]") return;
        yield JSON.parse(event.data);
      }
    }
  } finally {
    await reader.cancel().catch(() => undefined); // a consumer that stops early (or an abort) ends the request
  }
}
