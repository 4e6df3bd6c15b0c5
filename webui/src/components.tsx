// The page's presentational parts: messages (Markdown, reasoning, tool calls, figures), branch switchers,
// the settings panel and the small dialogs.

import { useEffect, useRef, useState } from "preact/hooks";
import type { Alternatives } from "./branches";
import { renderMarkdown } from "./markdown";
import { type Message, type ModelCard, type ReplyFigures, type Sampling, type ToolCall, textOf } from "./types";

/** Copies text to the clipboard (falling back to a selection where the Clipboard API is not offered). */
export async function copyText(text: string): Promise<void> {
  if (navigator.clipboard && window.isSecureContext) return navigator.clipboard.writeText(text);
  const area = document.createElement("textarea");
  area.value = text;
  document.body.append(area);
  area.select();
  document.execCommand("copy");
  area.remove();
}

function CopyButton({ text }: { text: () => string }) {
  const [copied, setCopied] = useState(false);
  return (
    <button
      class="small"
      onClick={async () => {
        await copyText(text());
        setCopied(true);
        setTimeout(() => setCopied(false), 1200);
      }}
    >
      {copied ? "Copied" : "Copy"}
    </button>
  );
}

/** Markdown rendered safely, each code block with a copy button. */
export function Markdown({ text }: { text: string }) {
  const ref = useRef<HTMLDivElement>(null);
  useEffect(() => {
    for (const block of ref.current?.querySelectorAll<HTMLDivElement>("div.code") ?? []) {
      if (block.querySelector("button.copy")) continue;
      const button = document.createElement("button");
      button.className = "copy small";
      button.textContent = "Copy";
      button.onclick = async () => {
        await copyText(block.querySelector("code")?.textContent ?? "");
        button.textContent = "Copied";
        setTimeout(() => (button.textContent = "Copy"), 1200);
      };
      block.prepend(button);
    }
  });
  return <div class="markdown" ref={ref} dangerouslySetInnerHTML={{ __html: renderMarkdown(text) }} />;
}

function prettyArguments(text: string): string {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return text;
  }
}

function ToolCallBlock({ call }: { call: ToolCall }) {
  return (
    <div class="tool-call">
      <div class="tool-head">
        Tool call <code>{call.function.name}</code>
        {call.id && <span class="muted"> {call.id}</span>}
      </div>
      <pre>{prettyArguments(call.function.arguments)}</pre>
    </div>
  );
}

/** The figures of a reply: speed, time to first token, prompt tokens and how many came from the cache, generated
 * tokens and how many came from verified drafts. */
export function Figures({ figures }: { figures: ReplyFigures }) {
  const parts = [
    figures.tokensPerSecond !== null && `${figures.tokensPerSecond.toFixed(1)} tok/s`,
    figures.ttftMs !== null && `TTFT ${(figures.ttftMs / 1000).toFixed(2)} s`,
    `${figures.promptTokens} prompt (${figures.cachedTokens} cached)`,
    `${figures.completionTokens} generated` + (figures.draftedTokens ? ` (${figures.draftedTokens} drafted)` : ""),
  ];
  return <div class="figures">{parts.filter(Boolean).join(" · ")}</div>;
}

/** ‹ 1/2 › between the branches that differ at one message. */
export function BranchSwitcher({ alternatives, onSwitch }: { alternatives: Alternatives; onSwitch: (id: string) => void }) {
  const { ids, current } = alternatives;
  return (
    <span class="branches" aria-label="answers">
      <button class="small" aria-label="previous answer" disabled={current === 0} onClick={() => onSwitch(ids[current - 1])}>
        ‹
      </button>
      <span class="branch-count">
        {current + 1}/{ids.length}
      </span>
      <button class="small" aria-label="next answer" disabled={current === ids.length - 1} onClick={() => onSwitch(ids[current + 1])}>
        ›
      </button>
    </span>
  );
}

interface MessageProps {
  message: Message;
  figures?: ReplyFigures | null;
  alternatives?: Alternatives | null;
  streaming?: boolean;
  note?: string;
  busy?: boolean;
  onSwitch?: (id: string) => void;
  onEdit?: (text: string) => void;
  onRegenerate?: () => void;
}

/** One message of the conversation with its actions. */
export function MessageView({ message, figures, alternatives, streaming, note, busy, onSwitch, onEdit, onRegenerate }: MessageProps) {
  const [editing, setEditing] = useState<string | null>(null);
  const text = textOf(message);
  if (message.role === "system" || message.role === "developer")
    return (
      <div class="message system">
        <span class="role">System</span> {text}
      </div>
    );
  if (message.role === "tool")
    return (
      <div class="message tool">
        <div class="tool-head">Tool result {message.tool_call_id && <code>{message.tool_call_id}</code>}</div>
        <pre>{text}</pre>
      </div>
    );
  const isUser = message.role === "user";
  return (
    <div class={`message ${message.role}${streaming ? " streaming" : ""}`}>
      {message.reasoning_content && (
        <details class="reasoning">
          <summary>Reasoning{streaming && !text ? "…" : ""}</summary>
          <div class="reasoning-text">{message.reasoning_content}</div>
        </details>
      )}
      {editing !== null ? (
        <form
          class="edit"
          onSubmit={(event) => {
            event.preventDefault();
            onEdit?.(editing);
            setEditing(null);
          }}
        >
          <textarea value={editing} rows={3} onInput={(event) => setEditing(event.currentTarget.value)} aria-label="edited message" />
          <div class="row">
            <button type="submit" class="primary small">Send edit</button>
            <button type="button" class="small" onClick={() => setEditing(null)}>Cancel</button>
          </div>
        </form>
      ) : isUser ? (
        <div class="user-text">{text}</div>
      ) : (
        <Markdown text={text} />
      )}
      {message.tool_calls?.map((call) => <ToolCallBlock key={call.id} call={call} />)}
      {note && <div class="note">{note}</div>}
      {figures && <Figures figures={figures} />}
      {!streaming && editing === null && (
        <div class="actions">
          {alternatives && onSwitch && <BranchSwitcher alternatives={alternatives} onSwitch={onSwitch} />}
          {isUser && onEdit && (
            <button class="small" disabled={busy} onClick={() => setEditing(text)}>Edit</button>
          )}
          {!isUser && onRegenerate && (
            <button class="small" disabled={busy} onClick={onRegenerate}>Regenerate</button>
          )}
          <CopyButton text={() => text} />
        </div>
      )}
    </div>
  );
}

const SAMPLING_FIELDS: [keyof Sampling, string, number][] = [
  ["temperature", "Temperature", 0.05],
  ["top_p", "Top p", 0.01],
  ["top_k", "Top k", 1],
  ["min_p", "Min p", 0.01],
  ["max_tokens", "Max tokens", 1],
  ["max_reasoning_tokens", "Reasoning budget", 1],
  ["seed", "Seed", 1],
];

interface SettingsProps {
  system: string;
  systemLocked: boolean;
  sampling: Sampling;
  models: ModelCard[];
  onSystem: (text: string) => void;
  onSampling: (sampling: Sampling) => void;
}

/** The conversation's system prompt, model and sampling settings (blank: the server's default). */
export function SettingsPanel({ system, systemLocked, sampling, models, onSystem, onSampling }: SettingsProps) {
  const defaults = models.find((model) => model.id === sampling.model)?.sampling_defaults ?? models[0]?.sampling_defaults ?? {};
  return (
    <div class="settings">
      <label>
        System prompt
        <textarea
          rows={3}
          value={system}
          disabled={systemLocked}
          placeholder="(none)"
          title={systemLocked ? "The conversation has started: start a new one to change its system prompt." : ""}
          onChange={(event) => onSystem(event.currentTarget.value)}
        />
      </label>
      <label>
        Model
        <select value={sampling.model ?? models[0]?.id} onChange={(event) => onSampling({ ...sampling, model: event.currentTarget.value })}>
          {models.map((model) => (
            <option key={model.id} value={model.id}>
              {model.id} ({model.max_model_len} tokens)
            </option>
          ))}
        </select>
      </label>
      <div class="grid">
        {SAMPLING_FIELDS.map(([field, label, step]) => (
          <label key={field}>
            {label}
            <input
              type="number"
              step={step}
              value={sampling[field] ?? ""}
              placeholder={defaults[field] == null ? "default" : String(defaults[field])}
              onChange={(event) => {
                const text = event.currentTarget.value;
                onSampling({ ...sampling, [field]: text === "" ? undefined : Number(text) });
              }}
            />
          </label>
        ))}
      </div>
    </div>
  );
}

interface AskProps {
  title: string;
  label?: string;
  initial?: string;
  secret?: boolean;
  error?: string | null;
  submit: string;
  onSubmit: (value: string) => void;
  onCancel?: () => void;
}

/** A small modal form: one text field (or none, for a confirmation), a submit button, and an error line. */
export function Ask({ title, label, initial = "", secret, error, submit, onSubmit, onCancel }: AskProps) {
  const [value, setValue] = useState(initial);
  const field = { value, autoFocus: true, onInput: (event: { currentTarget: HTMLInputElement }) => setValue(event.currentTarget.value) };
  return (
    <div class="modal-back" role="dialog" aria-modal="true" aria-label={title} onKeyDown={(event) => event.key === "Escape" && onCancel?.()}>
      <form
        class="modal"
        onSubmit={(event) => {
          event.preventDefault();
          onSubmit(value);
        }}
      >
        <h2>{title}</h2>
        {label !== undefined && (
          <label>
            {label}
            {secret ? <input type="password" {...field} /> : <input type="text" {...field} />}
          </label>
        )}
        {error && <div class="error" role="alert">{error}</div>}
        <div class="row">
          <button type="submit" class="primary">{submit}</button>
          {onCancel && <button type="button" onClick={onCancel}>Cancel</button>}
        </div>
      </form>
    </div>
  );
}
