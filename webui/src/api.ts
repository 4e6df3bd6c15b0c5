// The public API as the page uses it: every call carries the user's key, every error becomes an ApiError.

import { jsonEvents } from "./sse";
import type { Message, ModelCard, SessionObject, SnapshotObject } from "./types";

/** An answer of the server that is not a success, or no answer at all (status 0). */
export class ApiError extends Error {
  constructor(
    message: string,
    readonly status: number,
    readonly code: string | null = null,
    readonly retryAfter: number | null = null,
  ) {
    super(message);
  }

  /** Whether the server could not be reached (down, restarting, or the network is gone). */
  get unreachable(): boolean {
    return this.status === 0;
  }
}

/** What to tell the user about an error, in one line. */
export function describeError(error: unknown): string {
  if (!(error instanceof ApiError)) return error instanceof Error ? error.message : String(error);
  if (error.unreachable) return "The server cannot be reached; reconnecting…";
  if (error.status === 401)
    return error.code === "invalid_api_key" ? "The server refused this API key." : "This server needs an API key.";
  if (error.status === 429) {
    const wait = error.retryAfter === null ? "" : ` Retry in ${error.retryAfter} s.`;
    return `Too many requests: ${error.message}${wait}`;
  }
  if (error.code === "context_length_exceeded" || error.code === "prompt_too_long")
    return `The conversation no longer fits the model's context: ${error.message} Start a new conversation, or edit an earlier message.`;
  if (error.code === "session_busy") return "This conversation is busy with another reply; try again when it is done.";
  return `${error.message} (${error.status}${error.code ? `, ${error.code}` : ""})`;
}

async function errorOf(response: Response): Promise<ApiError> {
  let message = response.statusText || `HTTP ${response.status}`;
  let code: string | null = null;
  try {
    const body = await response.json();
    message = body.error?.message ?? message;
    code = body.error?.code ?? null;
  } catch {
    // not the API's JSON error shape: keep the status text
  }
  const retry = response.headers.get("retry-after");
  const retryAfter = retry !== null && /^\d+$/.test(retry) ? Number(retry) : null;
  return new ApiError(message, response.status, code, retryAfter);
}

/** The sessions, snapshots, models and chat routes, with the key the user gave (if any). */
export class Api {
  constructor(public key: string | null) {}

  /** A request to the API; ApiError unless it succeeds. */
  async request(method: string, path: string, body?: unknown, signal?: AbortSignal): Promise<Response> {
    const headers: Record<string, string> = {};
    if (this.key) headers.Authorization = `Bearer ${this.key}`;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    let response: Response;
    try {
      response = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body), signal });
    } catch (error) {
      if (signal?.aborted) throw error;
      throw new ApiError("the server cannot be reached", 0);
    }
    if (!response.ok) throw await errorOf(response);
    return response;
  }

  private async json<T>(method: string, path: string, body?: unknown): Promise<T> {
    return (await this.request(method, path, body)).json();
  }

  /** Whether the server answers at all (its public health route). */
  async healthy(): Promise<boolean> {
    try {
      return (await fetch("/health")).ok;
    } catch {
      return false;
    }
  }

  models = async (): Promise<ModelCard[]> => (await this.json<{ data: ModelCard[] }>("GET", "/v1/models")).data;
  sessions = async (): Promise<SessionObject[]> =>
    (await this.json<{ data: SessionObject[] }>("GET", "/v1/sessions")).data;
  history = async (id: string): Promise<Message[]> =>
    (await this.json<{ messages: Message[] }>("GET", `/v1/sessions/${id}/history`)).messages;
  createSession = (body: Record<string, unknown>): Promise<SessionObject> => this.json("POST", "/v1/sessions", body);
  setMetadata = (id: string, metadata: Record<string, string>): Promise<SessionObject> =>
    this.json("PATCH", `/v1/sessions/${id}`, { metadata });
  deleteSession = (id: string): Promise<unknown> => this.json("DELETE", `/v1/sessions/${id}`);
  rollback = (id: string, keep: number): Promise<SessionObject> =>
    this.json("POST", `/v1/sessions/${id}/rollback`, { keep_messages: keep });
  fork = (id: string, metadata: Record<string, string>): Promise<SessionObject> =>
    this.json("POST", `/v1/sessions/${id}/fork`, { metadata });
  snapshots = async (): Promise<SnapshotObject[]> =>
    (await this.json<{ data: SnapshotObject[] }>("GET", "/v1/snapshots")).data;
  saveSnapshot = (id: string, title: string): Promise<SnapshotObject> =>
    this.json("POST", `/v1/sessions/${id}/snapshot`, { title });
  loadSnapshot = (id: string): Promise<SessionObject> => this.json("POST", `/v1/snapshots/${id}/load`, {});
  deleteSnapshot = (id: string): Promise<unknown> => this.json("DELETE", `/v1/snapshots/${id}`);

  /** The chunks of a streamed session turn; aborting `signal` closes the stream, which cancels the turn. */
  async *chat(body: Record<string, unknown>, signal: AbortSignal): AsyncGenerator<unknown> {
    const response = await this.request("POST", "/v1/chat/completions", { ...body, stream: true, stream_options: { include_usage: true } }, signal);
    yield* jsonEvents(response.body!);
  }
}
