// A streamed chat reply assembled from its chunks.

import type { Message, ReplyFigures, Timings, ToolCall, Usage } from "./types";

interface ChunkToolCall {
  index: number;
  id?: string;
  function?: { name?: string; arguments?: string };
}

interface Chunk {
  choices?: { delta?: { content?: string | null; reasoning_content?: string; tool_calls?: ChunkToolCall[] }; finish_reason?: string | null }[];
  usage?: Usage | null;
  timings?: Timings;
  error?: { message: string; code?: string | null };
}

/** An error the server sent in the middle of a stream. */
export class StreamError extends Error {
  constructor(
    message: string,
    readonly code: string | null,
  ) {
    super(message);
  }
}

/** Accumulates the chunks of one streamed reply: text, reasoning, tool calls, finish reason and figures. */
export class ReplyBuilder {
  content = "";
  reasoning = "";
  toolCalls: ToolCall[] = [];
  finishReason: string | null = null;
  usage: Usage | null = null;
  timings: Timings | null = null;
  firstTokenAt: number | null = null;

  constructor(private readonly startedAt: number) {}

  /** Takes one chunk, received at time `now` (ms); throws StreamError for an error event. */
  add(chunk: unknown, now: number): void {
    const { choices, usage, timings, error } = chunk as Chunk;
    if (error) throw new StreamError(error.message, error.code ?? null);
    if (usage) this.usage = usage;
    if (timings) this.timings = timings;
    for (const choice of choices ?? []) {
      const delta = choice.delta ?? {};
      if (delta.content || delta.reasoning_content || delta.tool_calls?.length) this.firstTokenAt ??= now;
      this.content += delta.content ?? "";
      this.reasoning += delta.reasoning_content ?? "";
      for (const piece of delta.tool_calls ?? []) this.addToolCall(piece);
      if (choice.finish_reason) this.finishReason = choice.finish_reason;
    }
  }

  private addToolCall(piece: ChunkToolCall): void {
    const call = (this.toolCalls[piece.index] ??= { id: "", type: "function", function: { name: "", arguments: "" } });
    if (piece.id) call.id = piece.id;
    if (piece.function?.name) call.function.name = piece.function.name;
    call.function.arguments += piece.function?.arguments ?? "";
  }

  /** The reply as the session's transcript will hold it. */
  message(): Message {
    const message: Message = { role: "assistant", content: this.content };
    if (this.reasoning) message.reasoning_content = this.reasoning;
    if (this.toolCalls.length) message.tool_calls = this.toolCalls.filter(Boolean);
    return message;
  }

  /** Speed, time to first token and token counts, once the usage chunk has come. */
  figures(): ReplyFigures | null {
    if (this.usage === null) return null;
    return {
      tokensPerSecond: this.timings?.predicted_per_second || null,
      ttftMs: this.firstTokenAt === null ? null : this.firstTokenAt - this.startedAt,
      promptTokens: this.usage.prompt_tokens,
      cachedTokens: this.usage.prompt_tokens_details?.cached_tokens ?? 0,
      completionTokens: this.usage.completion_tokens,
      draftedTokens: this.timings?.draft_n_accepted ?? 0,
    };
  }
}
