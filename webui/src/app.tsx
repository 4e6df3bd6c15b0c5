// The page: the sidebar of conversations (the key's sessions) and snapshots, and the open conversation.

import { useCallback, useEffect, useMemo, useRef, useState } from "preact/hooks";
import { Api, ApiError, describeError } from "./api";
import { type Branch, alternativesAt, branchTime, conversationOf, conversations, titleFrom } from "./branches";
import { Ask, MessageView, SettingsPanel } from "./components";
import { ReplyBuilder } from "./reply";
import { stored } from "./storage";
import { type Message, type ModelCard, type ReplyFigures, type Sampling, type SessionObject, type SnapshotObject, textOf } from "./types";

const RECONNECT_MS = 1500;
const EXPORT_FORMAT = "statelm-conversation";

/** A turn on its way: the user's message and the reply as far as it has come. */
interface Pending {
  sessionId: string;
  user: Message;
  reply: Message;
  state: "streaming" | "stopped" | "failed";
}

type Dialog =
  | { kind: "key"; error: string | null }
  | { kind: "snapshot" }
  | { kind: "rename" }
  | { kind: "delete"; conversation: string };

function samplingOf(session: SessionObject | undefined): Sampling {
  try {
    return session?.metadata.settings ? JSON.parse(session.metadata.settings) : stored.newSettings().sampling;
  } catch {
    return {};
  }
}

function download(name: string, data: unknown): void {
  const url = URL.createObjectURL(new Blob([JSON.stringify(data, null, 2)], { type: "application/json" }));
  const link = Object.assign(document.createElement("a"), { href: url, download: name });
  link.click();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

export function App() {
  const api = useMemo(() => new Api(stored.key()), []);
  const [dialog, setDialog] = useState<Dialog | null>(null);
  const [models, setModels] = useState<ModelCard[]>([]);
  const [sessions, setSessions] = useState<SessionObject[]>([]);
  const [snapshots, setSnapshots] = useState<SnapshotObject[]>([]);
  const [open, setOpen] = useState<string | null>(stored.open());
  const [branchId, setBranchId] = useState<string | null>(null);
  const [branches, setBranches] = useState<Branch[]>([]);
  const [pending, setPending] = useState<Pending | null>(null);
  const [figures, setFigures] = useState<Record<string, ReplyFigures>>(stored.figures());
  const [error, setError] = useState<string | null>(null);
  const [offline, setOffline] = useState(false);
  const [draft, setDraft] = useState(stored.draft());
  const [newSettings, setNewSettings] = useState(stored.newSettings());
  const [showSettings, setShowSettings] = useState(false);
  const [sidebar, setSidebar] = useState(false);
  const abort = useRef<AbortController | null>(null);
  const bottom = useRef<HTMLDivElement>(null);

  const groups = useMemo(() => conversations(sessions), [sessions]);
  const current = branches.find((branch) => branch.id === branchId) ?? null;
  const session = sessions.find((entry) => entry.id === branchId);
  const sampling = open === null ? newSettings.sampling : samplingOf(session);
  const messages = current?.messages ?? [];
  const busy = pending?.state === "streaming";

  /** Reports an error: a lost server starts reconnecting, a refused key asks for another, the rest is shown. */
  const fail = useCallback((problem: unknown) => {
    if (problem instanceof ApiError && problem.unreachable) setOffline(true);
    else if (problem instanceof ApiError && problem.status === 401) setDialog({ kind: "key", error: describeError(problem) });
    else setError(describeError(problem));
  }, []);

  const refreshLists = useCallback(async () => {
    const [list, snaps] = await Promise.all([api.sessions(), api.snapshots()]);
    setSessions(list);
    setSnapshots([...snaps].reverse());
    return list;
  }, [api]);

  /** Loads a conversation's branches from the server and shows the remembered (or latest) one. */
  const openConversation = useCallback(
    async (conversation: string | null, list: SessionObject[], prefer?: string) => {
      setOpen(conversation);
      stored.setOpen(conversation);
      setPending(null);
      if (conversation === null) {
        setBranches([]);
        setBranchId(null);
        return;
      }
      const members = list.filter((entry) => conversationOf(entry) === conversation).sort((a, b) => b.last_used - a.last_used);
      if (members.length === 0) return openConversation(null, list);
      const loaded = await Promise.all(
        members.map(async (entry) => ({ id: entry.id, created: branchTime(entry), messages: await api.history(entry.id) })),
      );
      const remembered = prefer ?? stored.branch(conversation);
      const chosen = loaded.find((branch) => branch.id === remembered)?.id ?? members[0].id;
      setBranches(loaded);
      setBranchId(chosen);
      stored.setBranch(conversation, chosen);
    },
    [api],
  );

  const start = useCallback(async () => {
    try {
      setModels(await api.models());
      const list = await refreshLists();
      await openConversation(open, list, branchId ?? undefined);
      setOffline(false);
    } catch (problem) {
      fail(problem);
    }
  }, [api, refreshLists, openConversation, open, branchId, fail]);

  useEffect(() => void start(), []); // eslint-disable-line react-hooks/exhaustive-deps

  useEffect(() => {
    if (!offline) return;
    const timer = setInterval(async () => {
      if (await api.healthy()) {
        setOffline(false);
        setError(null);
        void start();
      }
    }, RECONNECT_MS);
    return () => clearInterval(timer);
  }, [offline, api, start]);

  useEffect(() => stored.setDraft(draft), [draft]);
  useEffect(() => bottom.current?.scrollIntoView({ block: "end" }), [messages.length, pending?.reply.content, pending?.state]);

  useEffect(() => {
    const onKey = (event: KeyboardEvent) => {
      if (event.key === "Escape" && abort.current) abort.current.abort();
    };
    window.addEventListener("keydown", onKey);
    return () => window.removeEventListener("keydown", onKey);
  }, []);

  const submitKey = async (key: string) => {
    const candidate = new Api(key.trim());
    try {
      await candidate.models();
    } catch (problem) {
      setDialog({ kind: "key", error: describeError(problem) });
      return;
    }
    api.key = candidate.key;
    stored.setKey(candidate.key);
    setDialog(null);
    await start();
  };

  /** Streams one turn into session `id` whose transcript before it is `base`; the branch then shows the result. */
  const turn = async (id: string, base: Message[], text: string) => {
    const user: Message = { role: "user", content: text };
    const controller = new AbortController();
    abort.current = controller;
    const builder = new ReplyBuilder(performance.now());
    setPending({ sessionId: id, user, reply: builder.message(), state: "streaming" });
    setError(null);
    let frame = 0;
    const show = () => {
      frame = 0;
      setPending({ sessionId: id, user, reply: builder.message(), state: "streaming" });
    };
    const { model, ...fields } = sampling;
    try {
      const body = { model: model ?? models[0]?.id ?? "default", messages: [user], session_id: id, ...fields };
      for await (const chunk of api.chat(body, controller.signal)) {
        builder.add(chunk, performance.now());
        frame ||= requestAnimationFrame(show);
      }
      cancelAnimationFrame(frame);
      const reply = builder.message();
      const replyFigures = builder.figures();
      if (replyFigures !== null) {
        const key = `${id}:${base.length + 1}`;
        stored.addFigures(key, replyFigures);
        setFigures((previous) => ({ ...previous, [key]: replyFigures }));
      }
      setBranches((previous) => previous.map((branch) => (branch.id === id ? { ...branch, messages: [...base, user, reply] } : branch)));
      setPending(null);
    } catch (problem) {
      cancelAnimationFrame(frame);
      const stopped = controller.signal.aborted;
      setPending({ sessionId: id, user, reply: builder.message(), state: stopped ? "stopped" : "failed" });
      setDraft((previous) => previous || text); // given back with the note, not after the history below arrives
      if (!stopped) fail(problem instanceof TypeError ? new ApiError("the stream was cut", 0) : problem);
      if (stopped || !(problem instanceof TypeError)) {
        const history = await api.history(id).catch(() => null); // the session as the server kept it
        if (history !== null) setBranches((previous) => previous.map((branch) => (branch.id === id ? { ...branch, messages: history } : branch)));
      }
    } finally {
      abort.current = null;
      refreshLists().catch(() => undefined);
    }
  };

  const send = async () => {
    const text = draft.trim();
    if (!text || busy) return;
    setDraft("");
    try {
      let id = branchId;
      if (open === null || id === null) {
        const metadata = { title: titleFrom(text), settings: JSON.stringify(newSettings.sampling) };
        const created = await api.createSession({ ...(newSettings.system ? { system: newSettings.system } : {}), metadata });
        id = created.id;
        const history = await api.history(id);
        setSessions((previous) => [created, ...previous]);
        setOpen(id);
        stored.setOpen(id);
        stored.setBranch(id, id);
        setBranches([{ id, created: branchTime(created), messages: history }]);
        setBranchId(id);
        await turn(id, history, text);
      } else {
        await turn(id, messages, text);
      }
    } catch (problem) {
      setDraft(text);
      fail(problem);
    }
  };

  /** Edits user message `index`: the session is rolled back to before it and the edit is sent. */
  const edit = async (index: number, text: string) => {
    if (branchId === null) return;
    try {
      await api.rollback(branchId, index);
      await turn(branchId, messages.slice(0, index), text);
    } catch (problem) {
      fail(problem);
    }
  };

  /** Another answer to the user message before `index`, in a fork: the earlier answer stays in its branch. */
  const regenerate = async (index: number) => {
    if (branchId === null || open === null || session === undefined) return;
    const question = messages[index - 1];
    try {
      const fork = await api.fork(branchId, { ...session.metadata, conversation: open, forked: String(Date.now()) });
      await api.rollback(fork.id, index - 1);
      const base = messages.slice(0, index - 1);
      setSessions((previous) => [fork, ...previous]);
      setBranches((previous) => [...previous, { id: fork.id, created: branchTime(fork), messages: base }]);
      setBranchId(fork.id);
      stored.setBranch(open, fork.id);
      await turn(fork.id, base, textOf(question));
    } catch (problem) {
      fail(problem);
    }
  };

  const switchBranch = (id: string) => {
    setBranchId(id);
    setPending(null);
    if (open !== null) stored.setBranch(open, id);
  };

  const act = async (action: () => Promise<unknown>) => {
    try {
      await action();
    } catch (problem) {
      fail(problem);
    }
  };

  const updateSampling = (next: Sampling) => {
    if (open === null) {
      const value = { ...newSettings, sampling: next };
      setNewSettings(value);
      stored.setNewSettings(value);
      return;
    }
    const settings = JSON.stringify(next);
    const members = sessions.filter((entry) => conversationOf(entry) === open);
    void act(async () => {
      const updated = await Promise.all(members.map((entry) => api.setMetadata(entry.id, { ...entry.metadata, settings })));
      setSessions((previous) => previous.map((entry) => updated.find((changed) => changed.id === entry.id) ?? entry));
    });
  };

  const rename = (title: string) =>
    act(async () => {
      const members = sessions.filter((entry) => conversationOf(entry) === open);
      await Promise.all(members.map((entry) => api.setMetadata(entry.id, { ...entry.metadata, title: titleFrom(title) })));
      setDialog(null);
      await refreshLists();
    });

  const remove = (conversation: string) =>
    act(async () => {
      const members = sessions.filter((entry) => conversationOf(entry) === conversation);
      await Promise.all(members.map((entry) => api.deleteSession(entry.id)));
      setDialog(null);
      const list = await refreshLists();
      if (conversation === open) await openConversation(null, list);
    });

  const saveSnapshot = (title: string) =>
    act(async () => {
      if (branchId === null) return;
      await api.saveSnapshot(branchId, title.trim() || "snapshot");
      setDialog(null);
      await refreshLists();
    });

  const loadSnapshot = (snapshot: SnapshotObject) =>
    act(async () => {
      const loaded = await api.loadSnapshot(snapshot.id);
      const title = snapshot.title || `Snapshot ${snapshot.id}`;
      await api.setMetadata(loaded.id, { title, settings: JSON.stringify(sampling) });
      const list = await refreshLists();
      await openConversation(loaded.id, list);
      setSidebar(false);
    });

  const exportConversation = () => {
    const title = groups.find((group) => group.id === open)?.title ?? "conversation";
    download(`${title.replace(/[^\w.-]+/g, "_").slice(0, 60) || "conversation"}.json`, {
      format: EXPORT_FORMAT,
      version: 1,
      title,
      settings: sampling,
      messages,
    });
  };

  const importConversation = (file: File) =>
    act(async () => {
      const data = JSON.parse(await file.text());
      if (data?.format !== EXPORT_FORMAT || !Array.isArray(data.messages)) throw new Error("This file is not a conversation exported by statelm.");
      const metadata = { title: titleFrom(String(data.title || file.name)), settings: JSON.stringify(data.settings ?? {}) };
      const created = await api.createSession({ messages: data.messages, metadata });
      const list = await refreshLists();
      await openConversation(created.id, list);
    });

  const title = open === null ? "New conversation" : (groups.find((group) => group.id === open)?.title ?? open);
  const systemText = open === null ? newSettings.system : messages[0]?.role === "system" ? String(messages[0].content ?? "") : "";
  const fileInput = useRef<HTMLInputElement>(null);

  return (
    <div class={`layout${sidebar ? " sidebar-open" : ""}`}>
      <aside class="sidebar">
        <div class="row">
          <button class="primary wide" onClick={() => (openConversation(null, sessions), setSidebar(false))} disabled={busy}>
            New conversation
          </button>
        </div>
        <nav aria-label="conversations">
          <ul class="conversations">
            {groups.map((group) => (
              <li key={group.id} class={group.id === open ? "active" : ""}>
                <button
                  class="conversation"
                  disabled={busy}
                  title={group.title}
                  onClick={() => act(() => openConversation(group.id, sessions)).then(() => setSidebar(false))}
                >
                  {group.title}
                  {group.branches.length > 1 && <span class="muted"> · {group.branches.length} branches</span>}
                </button>
                <button class="small icon" aria-label={`delete ${group.title}`} disabled={busy} onClick={() => setDialog({ kind: "delete", conversation: group.id })}>
                  ×
                </button>
              </li>
            ))}
          </ul>
        </nav>
        <h3>Snapshots</h3>
        <ul class="snapshots">
          {snapshots.map((snapshot) => (
            <li key={snapshot.id}>
              <span class="snapshot-title" title={snapshot.id}>
                {snapshot.title || snapshot.id}
                <span class="muted"> · {snapshot.num_tokens} tokens</span>
              </span>
              <button class="small" disabled={busy} onClick={() => loadSnapshot(snapshot)}>Load</button>
              <button class="small icon" aria-label={`delete snapshot ${snapshot.title || snapshot.id}`} onClick={() => act(async () => (await api.deleteSnapshot(snapshot.id), await refreshLists()))}>
                ×
              </button>
            </li>
          ))}
          {snapshots.length === 0 && <li class="muted">None yet: save one from a conversation.</li>}
        </ul>
        <div class="row">
          <button class="small" onClick={() => fileInput.current?.click()}>Import…</button>
          <input ref={fileInput} type="file" accept="application/json,.json" hidden onChange={(event) => {
            const file = event.currentTarget.files?.[0];
            if (file) void importConversation(file);
            event.currentTarget.value = "";
          }} />
        </div>
      </aside>
      <main class="chat">
        <header>
          <button class="small icon menu" aria-label="conversations" onClick={() => setSidebar(!sidebar)}>☰</button>
          <h1 title={title}>{title}</h1>
          <div class="row">
            {open !== null && <button class="small" onClick={() => setDialog({ kind: "rename" })}>Rename</button>}
            {open !== null && <button class="small" disabled={busy} onClick={() => setDialog({ kind: "snapshot" })}>Save snapshot</button>}
            {open !== null && <button class="small" onClick={exportConversation}>Export</button>}
            <button class="small" aria-expanded={showSettings} onClick={() => setShowSettings(!showSettings)}>Settings</button>
          </div>
        </header>
        {offline && <div class="banner" role="status">The server cannot be reached; reconnecting… (nothing on this page is lost)</div>}
        {error && (
          <div class="banner error" role="alert">
            {error} <button class="small" onClick={() => setError(null)}>Dismiss</button>
          </div>
        )}
        {showSettings && (
          <SettingsPanel
            system={systemText}
            systemLocked={open !== null}
            sampling={sampling}
            models={models}
            onSystem={(system) => {
              const value = { ...newSettings, system };
              setNewSettings(value);
              stored.setNewSettings(value);
            }}
            onSampling={updateSampling}
          />
        )}
        <section class="messages" aria-live="polite">
          {messages.length === 0 && !pending && <p class="empty muted">Ask anything. Enter sends, Shift+Enter adds a line, Esc stops a reply.</p>}
          {messages.map((message, index) => (
            <MessageView
              key={`${branchId}:${index}`}
              message={message}
              figures={figures[`${branchId}:${index}`]}
              alternatives={alternativesAt(branches, branchId ?? "", index)}
              busy={busy}
              onSwitch={switchBranch}
              onEdit={message.role === "user" ? (text) => edit(index, text) : undefined}
              onRegenerate={message.role === "assistant" && messages[index - 1]?.role === "user" ? () => regenerate(index) : undefined}
            />
          ))}
          {pending && pending.sessionId === branchId && (
            <>
              {pending.state !== "streaming" && <div class="note">{pending.state === "stopped" ? "Stopped: this turn was not kept in the conversation." : "This turn failed and was not kept."}</div>}
              <MessageView message={pending.user} streaming />
              <MessageView message={pending.reply} streaming={busy} />
            </>
          )}
          <div ref={bottom} />
        </section>
        <form
          class="composer"
          onSubmit={(event) => {
            event.preventDefault();
            void send();
          }}
        >
          <textarea
            aria-label="message"
            placeholder="Message"
            rows={2}
            value={draft}
            onInput={(event) => setDraft(event.currentTarget.value)}
            onKeyDown={(event) => {
              if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
                event.preventDefault();
                void send();
              }
            }}
          />
          {busy ? (
            <button type="button" class="stop" onClick={() => abort.current?.abort()}>Stop</button>
          ) : (
            <button type="submit" class="primary" disabled={!draft.trim() || offline}>Send</button>
          )}
        </form>
      </main>
      {dialog?.kind === "key" && (
        <Ask title="API key" label="This server needs an API key. It is kept in this browser." secret error={dialog.error} submit="Use key" onSubmit={submitKey} />
      )}
      {dialog?.kind === "snapshot" && (
        <Ask title="Save snapshot" label="Title" initial={title} submit="Save" onSubmit={saveSnapshot} onCancel={() => setDialog(null)} />
      )}
      {dialog?.kind === "rename" && (
        <Ask title="Rename conversation" label="Title" initial={title} submit="Rename" onSubmit={rename} onCancel={() => setDialog(null)} />
      )}
      {dialog?.kind === "delete" && (
        <Ask
          title={`Delete “${groups.find((group) => group.id === dialog.conversation)?.title ?? dialog.conversation}” and all its branches?`}
          submit="Delete"
          onSubmit={() => remove(dialog.conversation)}
          onCancel={() => setDialog(null)}
        />
      )}
    </div>
  );
}

