// What the page keeps in the browser between visits: the key, the open conversation and branch, the draft, and
// the figures of replies generated here (the server does not keep them).

import type { ReplyFigures, Sampling } from "./types";

const PREFIX = "statelm.";
const MAX_FIGURES = 500;

function read<T>(name: string, fallback: T): T {
  try {
    const text = localStorage.getItem(PREFIX + name);
    return text === null ? fallback : (JSON.parse(text) as T);
  } catch {
    return fallback;
  }
}

function write(name: string, value: unknown): void {
  try {
    if (value === null || value === undefined) localStorage.removeItem(PREFIX + name);
    else localStorage.setItem(PREFIX + name, JSON.stringify(value));
  } catch {
    // storage full or disabled: the page still works, it only forgets more on reload
  }
}

export const stored = {
  key: (): string | null => read<string | null>("key", null),
  setKey: (key: string | null): void => write("key", key),
  open: (): string | null => read<string | null>("open", null),
  setOpen: (id: string | null): void => write("open", id),
  branch: (conversation: string): string | null => read<Record<string, string>>("branches", {})[conversation] ?? null,
  setBranch(conversation: string, id: string): void {
    write("branches", { ...read<Record<string, string>>("branches", {}), [conversation]: id });
  },
  draft: (): string => read("draft", ""),
  setDraft: (text: string): void => write("draft", text || null),
  newSettings: (): { system: string; sampling: Sampling } => read("new", { system: "", sampling: {} }),
  setNewSettings: (value: { system: string; sampling: Sampling }): void => write("new", value),
  figures: (): Record<string, ReplyFigures> => read("figures", {}),
  addFigures(key: string, figures: ReplyFigures): void {
    const entries = Object.entries({ ...read<Record<string, ReplyFigures>>("figures", {}), [key]: figures });
    write("figures", Object.fromEntries(entries.slice(-MAX_FIGURES)));
  },
};
