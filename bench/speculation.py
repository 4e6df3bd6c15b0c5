"""Prompt-lookup drafts (--speculative-tokens) on replies that quote their prompt, and on one that does not.

Usage: .venv/bin/python -m bench.speculation [--llama-server PATH] [--model default] [--draft-tokens 4]
           [--max-tokens 256] [--rounds 2] [--json PATH]
One stream, streamed. Each task is a chat request built from this repository's own text, greedy: repeat a
paragraph, edit a function and show it whole, answer a question about a document by quoting it, write a story
(nothing to quote, though a small model's greedy story may repeat itself); and the story sampled (temperature 0.8,
seeded): what drafts that miss cost. The servers, one at a time, order alternating over the rounds:
statelm without drafts (--speculative-tokens 0), statelm with them, and llama-server on the same GGUF (default
settings, no speculation) where given. Per task: decode tokens a second (the reply's tokens after the first over
the time between the first and last content chunks), the best of the rounds; the share of verified draft tokens
taken (from /metrics); and whether statelm's replies with and without drafts are the same text (they must be).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import re
import shlex
from pathlib import Path

import httpx

from bench.common import ROOT, launch, machine_report, start_server
from bench.peers import LLAMA, Server, find_llama_server, llama_version, stop
from bench.throughput import fmt, make_target, timed_request
from statelm.models.loader import resolve_source

STATELM_PORT, LLAMA_PORT = 8794, 8795
STORY = "Write a short story about a lighthouse keeper who finds a message in a bottle."
SAMPLED_STORY = "write a story, sampled"  # temperature 0.8, seeded: the greedy story may repeat itself, this one not


def paragraph(path: str, start: str, lines: int) -> str:
    """`lines` lines of a file of this repository from the first line that starts with `start`."""
    text = (ROOT / path).read_text().splitlines()
    first = next(i for i, line in enumerate(text) if line.startswith(start))
    return "\n".join(text[first : first + lines])


def tasks() -> dict[str, str]:
    """Each task's user message."""
    readme = paragraph("README.md", "- **Paged KV cache", 8)
    code = paragraph("statelm/engine/kv_manager.py", "    def grow(", 10)
    doc = paragraph("docs/sessions.md", "#", 30)
    return {
        "repeat a paragraph": f"Repeat the following text exactly, word for word.\n\n{readme}",
        "edit code": f"Rename the variable `missing` to `lacking` in this Python method and show the whole method.\n\n"
        f"```python\n{code}\n```",
        "quote a document": f"{doc}\n\nQuote the sentences of this document that say what a session keeps.",
        "write a story": STORY,
        SAMPLED_STORY: STORY,
    }


def draft_counts(port: int) -> tuple[float, float]:
    """statelm's draft tokens verified and taken so far, from /metrics."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    figures = []
    for name in ("statelm_draft_tokens_total", "statelm_draft_tokens_accepted_total"):
        match = re.search(rf"^{name} ([0-9.e+]+)$", text, re.MULTILINE)
        figures.append(float(match.group(1)) if match else 0.0)
    return figures[0], figures[1]


async def run_tasks(server: Server, prompts: dict[str, str], max_tokens: int) -> dict[str, dict[str, object]]:
    """Each task once against a running server: decode rate, reply text and (statelm's) draft tokens."""
    statelm = server.label != LLAMA  # llama-server's /metrics (off by default) has no draft counters
    target = make_target(server.label, f"http://127.0.0.1:{server.port}", None, False, 600)
    results: dict[str, dict[str, object]] = {}
    try:
        target.model = (await target.client.models.list()).data[0].id
        await timed_request(target, 0, "Say hello.", 8, 600)  # warm-up
        for request_id, (name, prompt) in enumerate(prompts.items(), start=1):
            before = draft_counts(server.port) if statelm else (0.0, 0.0)
            temperature = 0.8 if name == SAMPLED_STORY else 0.0
            result = await timed_request(target, request_id, prompt, max_tokens, 600, temperature=temperature)
            if not result.ok:
                raise SystemExit(f"{server.label}: {name}: {result.error}")
            after = draft_counts(server.port) if statelm else (0.0, 0.0)
            verified, taken = after[0] - before[0], after[1] - before[1]
            results[name] = {
                "decode_tok_s": result.decode_tok_s,
                "completion_tokens": result.completion_tokens,
                "text": result.text,
                "draft_tokens": verified,
                "draft_tokens_accepted": taken,
            }
            drafts = f", drafts {taken:.0f} of {verified:.0f} taken" if statelm else ""
            print(
                f"  {name}: {result.completion_tokens} tokens, {fmt(result.decode_tok_s)} decode tok/s{drafts}",
                flush=True,
            )
    finally:
        await target.client.close()
    return results


def main() -> None:
    """Run the servers in alternating rounds and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", type=Path, help="llama-server binary; without it statelm runs alone")
    parser.add_argument("--model", default="default", help="a GGUF file, or `default`")
    parser.add_argument("--draft-tokens", type=int, default=4, help="statelm's --speculative-tokens when drafting")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="llama-server's -t")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    gguf = resolve_source(args.model).path
    prompts = tasks()
    serve = ["--model", str(gguf)]
    servers = []
    for label, drafts in (("statelm, no drafts", 0), (f"statelm, drafts of {args.draft_tokens}", args.draft_tokens)):
        serve_args = [*serve, "--speculative-tokens", str(drafts)]
        shown = shlex.join(["statelm", "serve", *serve_args, "--port", str(STATELM_PORT)])
        servers.append(Server(label, STATELM_PORT, shown, functools.partial(start_server, serve_args, STATELM_PORT)))
    header = [
        machine_report(),
        f"model: {gguf}",
        f"settings: one stream, greedy but the sampled story, max_tokens {args.max_tokens}",
    ]
    if args.llama_server is not None:
        llama = find_llama_server(args.llama_server)
        command = [
            str(llama),
            "-m",
            str(gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(LLAMA_PORT),
            "-t",
            str(args.threads),
        ]
        servers.append(Server(LLAMA, LLAMA_PORT, shlex.join(command), functools.partial(launch, command, LLAMA_PORT)))
        header.append(f"llama-server: {llama_version(llama)}: {shlex.join(command)}")
    print("\n".join(header), flush=True)
    runs: dict[str, list[dict[str, dict[str, object]]]] = {server.label: [] for server in servers}
    for round_number in range(args.rounds):
        order = servers if round_number % 2 == 0 else servers[::-1]
        for server in order:
            process, up_s = server.start()
            print(f"{server.label} (round {round_number + 1}): up in {up_s:.1f} s", flush=True)
            try:
                runs[server.label].append(asyncio.run(run_tasks(server, prompts, args.max_tokens)))
            finally:
                stop(process)
    print_table(servers, runs, prompts)
    if args.json is not None:
        args.json.write_text(json.dumps({"header": header, "runs": runs}, indent=1))


def print_table(
    servers: list[Server], runs: dict[str, list[dict[str, dict[str, object]]]], prompts: dict[str, str]
) -> None:
    """Best decode rate per task and server, the drafts' gain, the share of draft tokens taken, and exactness."""
    plain, drafting = servers[0].label, servers[1].label
    peer = servers[2].label if len(servers) > 2 else None
    columns = [plain, drafting, "drafts / no drafts", "draft tokens taken", "same replies"]
    if peer is not None:
        columns[2:2] = [peer]
        columns.append("drafts / llama-server")
    print("\n| task | " + " | ".join(columns) + " |")
    print("| --- |" + " ---: |" * len(columns))
    for name in prompts:
        best = {label: max(float(run[name]["decode_tok_s"] or 0) for run in runs[label]) for label in runs}
        verified = sum(float(run[name]["draft_tokens"]) for run in runs[drafting])
        taken = sum(float(run[name]["draft_tokens_accepted"]) for run in runs[drafting])
        texts = {run[name]["text"] for label in (plain, drafting) for run in runs[label]}
        cells = [f"{best[plain]:.1f}", f"{best[drafting]:.1f}"]
        if peer is not None:
            cells.append(f"{best[peer]:.1f}")
        cells += [
            f"{best[drafting] / best[plain]:.2f}x",
            f"{taken:.0f} of {verified:.0f}",
            "yes" if len(texts) == 1 else "NO",
        ]
        if peer is not None:
            cells.append(f"{best[drafting] / best[peer]:.2f}x")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
