import { describe, expect, it } from "vitest";
import { type Branch, alternativesAt, branchTime, conversations, titleFrom } from "./branches";
import type { Message, SessionObject } from "./types";

const user = (content: string): Message => ({ role: "user", content });
const assistant = (content: string): Message => ({ role: "assistant", content });

function session(id: string, lastUsed: number, metadata: Record<string, string> = {}): SessionObject {
  return { id, created: lastUsed, last_used: lastUsed, num_tokens: 0, num_messages: 0, state: "resident", system: null, metadata };
}

describe("conversations", () => {
  it("groups branches under their root, newest first, with the root's title", () => {
    const groups = conversations([
      session("a", 10, { title: "Alpha" }),
      session("b", 30, { title: "Alpha", conversation: "a" }),
      session("c", 20, { title: "Gamma" }),
      session("d", 5),
    ]);
    expect(groups.map((group) => [group.id, group.title, group.branches.map((branch) => branch.id)])).toEqual([
      ["a", "Alpha", ["b", "a"]],
      ["c", "Gamma", ["c"]],
      ["d", "d", ["d"]],
    ]);
  });

  it("orders a fork by when it was forked, to the millisecond", () => {
    expect(branchTime(session("a", 10))).toBe(10_000);
    expect(branchTime(session("b", 10, { forked: "10250" }))).toBe(10_250);
  });

  it("makes one-line titles of first messages", () => {
    expect(titleFrom("  What is\n the capital?  ")).toBe("What is the capital?");
    expect(titleFrom("x".repeat(100))).toHaveLength(80);
  });
});

describe("alternativesAt", () => {
  const question = [user("Q1"), assistant("A1"), user("Q2")];
  const branches: Branch[] = [
    { id: "first", created: 1, messages: [...question, assistant("A2")] },
    { id: "second", created: 2, messages: [...question, assistant("A2 again")] },
    { id: "third", created: 3, messages: [...question, assistant("A2"), user("Q3")] },
    { id: "other", created: 4, messages: [user("Q1"), assistant("B1")] },
  ];

  it("lists the branches that differ at a message after the same history, one per distinct message", () => {
    expect(alternativesAt(branches, "second", 3)).toEqual({ ids: ["first", "second"], current: 1 });
    expect(alternativesAt(branches, "third", 3)).toEqual({ ids: ["second", "third"], current: 1 });
    expect(alternativesAt(branches, "first", 1)).toEqual({ ids: ["first", "other"], current: 0 });
  });

  it("gives nothing where every branch agrees or the message is past the branch", () => {
    expect(alternativesAt(branches, "first", 0)).toBeNull();
    expect(alternativesAt(branches, "first", 2)).toBeNull();
    expect(alternativesAt(branches, "third", 4)).toBeNull();
    expect(alternativesAt(branches, "missing", 0)).toBeNull();
  });
});
