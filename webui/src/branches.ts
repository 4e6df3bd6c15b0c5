// Conversations and their branches, kept in the sessions' metadata: a conversation is its first session (the
// root) and the sessions forked from it, each a branch with `metadata.conversation` naming the root.

import { type Message, type SessionObject, textOf } from "./types";

/** One conversation of the sidebar: its branches, most recently used first. */
export interface Conversation {
  id: string;
  title: string;
  lastUsed: number;
  branches: SessionObject[];
}

/** A branch of the open conversation with its transcript; branches are ordered by `created` (ms). */
export interface Branch {
  id: string;
  created: number;
  messages: Message[];
}

/** The alternatives at one position of the current branch: the branches to switch to and which one is shown. */
export interface Alternatives {
  ids: string[];
  current: number;
}

const TITLE_LENGTH = 80;

/** The conversation a session belongs to. */
export function conversationOf(session: SessionObject): string {
  return session.metadata.conversation || session.id;
}

/** When a session became a branch, in ms: when it was forked (kept in its metadata) or else created. */
export function branchTime(session: SessionObject): number {
  return Number(session.metadata.forked) || session.created * 1000;
}

/** A title made of a conversation's first user message. */
export function titleFrom(text: string): string {
  const line = text.trim().replace(/\s+/g, " ");
  return line.length > TITLE_LENGTH ? `${line.slice(0, TITLE_LENGTH - 1)}…` : line;
}

/** Sessions grouped into conversations, the most recently used first. */
export function conversations(sessions: SessionObject[]): Conversation[] {
  const groups = new Map<string, SessionObject[]>();
  for (const session of sessions) {
    const id = conversationOf(session);
    groups.set(id, [...(groups.get(id) ?? []), session]);
  }
  const result = [...groups].map(([id, branches]) => {
    branches.sort((a, b) => b.last_used - a.last_used);
    const root = branches.find((branch) => branch.id === id) ?? branches[0];
    return {
      id,
      title: root.metadata.title || branches.find((branch) => branch.metadata.title)?.metadata.title || id,
      lastUsed: branches[0].last_used,
      branches,
    };
  });
  return result.sort((a, b) => b.lastUsed - a.lastUsed);
}

/** What identifies a message for comparing branches (reasoning left out: templates may drop it from history). */
function messageKey(message: Message): string {
  return JSON.stringify([message.role, textOf(message), message.tool_calls ?? null]);
}

/** Whether two transcripts hold the same first `length` messages. */
function samePrefix(a: Message[], b: Message[], length: number): boolean {
  if (a.length < length || b.length < length) return false;
  for (let i = 0; i < length; i++) if (messageKey(a[i]) !== messageKey(b[i])) return false;
  return true;
}

/**
 * The branches that share the current branch's messages before `index` and differ at `index` (one per distinct
 * message there, the current branch standing for its own), oldest first; null when there is no other.
 */
export function alternativesAt(branches: Branch[], currentId: string, index: number): Alternatives | null {
  const current = branches.find((branch) => branch.id === currentId);
  if (current === undefined || index >= current.messages.length) return null;
  const byMessage = new Map<string, Branch>();
  const ordered = [...branches].sort((a, b) => a.created - b.created || a.id.localeCompare(b.id));
  for (const branch of ordered) {
    if (!samePrefix(branch.messages, current.messages, index) || branch.messages.length <= index) continue;
    const key = messageKey(branch.messages[index]);
    if (branch.id === currentId || !byMessage.has(key)) byMessage.set(key, branch);
  }
  if (byMessage.size < 2) return null;
  const ids = [...byMessage.values()].sort((a, b) => a.created - b.created || a.id.localeCompare(b.id)).map((b) => b.id);
  return { ids, current: ids.indexOf(currentId) };
}
