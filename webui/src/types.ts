// The shapes of the API's objects that the page reads (docs/api.md, docs/sessions.md).

export interface ToolCall {
  id: string;
  type: "function";
  function: { name: string; arguments: string };
}

/** A transcript message as a session keeps it. */
export interface Message {
  role: "system" | "developer" | "user" | "assistant" | "tool";
  content?: string | { type: "text"; text: string }[] | null;
  reasoning_content?: string;
  tool_calls?: ToolCall[];
  tool_call_id?: string;
  name?: string;
}

export interface SessionObject {
  id: string;
  created: number;
  last_used: number;
  num_tokens: number;
  num_messages: number;
  state: "resident" | "spilled" | "busy";
  system: string | null;
  metadata: Record<string, string>;
}

export interface SnapshotObject {
  id: string;
  created: number;
  session_id: string | null;
  num_tokens: number;
  num_messages: number;
  size_bytes: number;
  title: string | null;
}

export interface ModelCard {
  id: string;
  max_model_len: number;
  sampling_defaults: Record<string, number | null>;
}

export interface Usage {
  prompt_tokens: number;
  completion_tokens: number;
  prompt_tokens_details?: { cached_tokens: number };
}

export interface Timings {
  predicted_per_second: number;
  prompt_ms: number;
  draft_n_accepted?: number; // generated tokens that came from verified drafts (only where drafts ran)
}

/** The figures shown under a reply. */
export interface ReplyFigures {
  tokensPerSecond: number | null;
  ttftMs: number | null;
  promptTokens: number;
  cachedTokens: number;
  completionTokens: number;
  draftedTokens: number; // of which from verified drafts (prompt lookup)
}

/** Sampling settings of a conversation; unset fields take the server's defaults. */
export interface Sampling {
  model?: string;
  temperature?: number;
  top_p?: number;
  top_k?: number;
  min_p?: number;
  max_tokens?: number;
  max_reasoning_tokens?: number;
  seed?: number;
}

/** The text of a message's content. */
export function textOf(message: Message): string {
  const content = message.content;
  if (content == null) return "";
  return typeof content === "string" ? content : content.map((part) => part.text).join("");
}
