"""statelm against llama.cpp's llama-server on the same GGUF: streamed decode, TTFT and start-up, one server at a time.

Usage: .venv/bin/python -m bench.peers [--llama-server PATH] [--concurrency 1,4,16,64] [--rounds 2]
           [--output-tokens 128] [--requests-per-stream 3] [--prompt-tokens 64] [--ttft-prompt-tokens 512]
           [--ttft-requests 5]
           [--servers llama-server,statelm] [--statelm-args ARGS] [--llama-args ARGS] [--pick best|median]
           [--json PATH]
Each server runs alone: it is started (timed to /health 200), measured and stopped before the other starts, and
the order alternates over the rounds. Without --llama-server it runs ../shared/peers/build-llama-server (relative
to the repository root), which builds llama-server once (about 10 minutes on 2 cores) and prints its path.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import ROOT, launch, machine_report, start_server
from bench.throughput import RequestResult, Target, build_prompt, calibrate, fmt, make_target, run_level, timed_request
from statelm.models.loader import resolve_source

LLAMA = "llama-server"
STATELM = "statelm"
BUILD_SCRIPT = ROOT.parent / "shared" / "peers" / "build-llama-server"
FOLLOW_UP_QUESTION = "Say that again in one sentence."
SLOT_MARGIN_TOKENS = 64  # chat template and calibration overshoot on top of prompt + output per llama-server slot


@dataclass
class Server:
    """A server under test: its label, port, the command line shown, and how to start it."""

    label: str
    port: int
    shown: str
    start: Callable[[], tuple[subprocess.Popen[bytes], float]]


@dataclass
class Metric:
    """One row of the comparison table and how to read it from a measured run."""

    name: str
    higher_is_better: bool
    read: Callable[[dict[str, Any]], float | None]


def find_llama_server(path: Path | None) -> Path:
    """--llama-server, else the path the shared build script prints last (it builds llama-server first if needed)."""
    if path is None:
        if not BUILD_SCRIPT.is_file():
            raise SystemExit(f"no --llama-server given and no build script at {BUILD_SCRIPT}")
        print(f"finding llama-server with {BUILD_SCRIPT} (the first time it builds it: ~10 minutes)", flush=True)
        built = subprocess.run([str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True)
        lines = built.stdout.strip().splitlines()
        if built.returncode != 0 or not lines:
            raise SystemExit(f"{BUILD_SCRIPT} failed with code {built.returncode}")
        path = Path(lines[-1])
    if not os.access(path, os.X_OK):
        raise SystemExit(f"not an executable: {path}")
    return path


def llama_version(path: Path) -> str:
    """What `llama-server --version` says (version and compiler), on one line."""
    done = subprocess.run([str(path), "--version"], capture_output=True, text=True)
    lines = [line.strip() for line in (done.stdout + done.stderr).splitlines()]
    return "; ".join(line for line in lines if line.startswith(("version", "built with"))) or "unknown"


def build_with_libllama(llama_server: Path, source: str, program: Path) -> Path:
    """Compile a C program (its text) against the libllama of llama-server's build; returns the program's path."""
    bin_dir = llama_server.parent
    root = bin_dir.parent.parent
    source_file = program.with_suffix(".c")
    source_file.write_text(source)
    includes = [f"-I{root / 'include'}", f"-I{root / 'ggml' / 'include'}"]
    link = [f"-L{bin_dir}", "-lllama", f"-Wl,-rpath,{bin_dir}"]
    subprocess.run(["cc", "-O1", "-o", str(program), str(source_file), *includes, *link], check=True)
    return program


def stop(process: subprocess.Popen[bytes]) -> None:
    """Terminate a server and wait for it to exit (killed after 60 s)."""
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def make_servers(
    args: argparse.Namespace, llama: Path | None, gguf: Path, levels: list[int], model: str = "default"
) -> list[Server]:
    """The servers asked for by --servers, on the same GGUF (statelm's `--model` spelled as `model`), llama-server
    sized with a slot per stream of the largest level."""
    servers = []
    for label in args.servers.split(","):
        if label == LLAMA and llama is not None:
            slots = max(levels)
            slot_ctx = max(args.prompt_tokens, args.ttft_prompt_tokens) + args.output_tokens + SLOT_MARGIN_TOKENS
            command = [
                str(llama),
                *("-m", str(gguf), "--host", "127.0.0.1", "--port", str(args.llama_port)),
                *("-c", str(slots * slot_ctx), "-np", str(slots), "-t", str(args.threads)),
                *shlex.split(args.llama_args),
            ]
            start = functools.partial(launch, command, args.llama_port)
            servers.append(Server(LLAMA, args.llama_port, shlex.join(command), start))
        elif label == STATELM:
            serve = ["--model", model, *shlex.split(args.statelm_args)]
            shown = shlex.join(["statelm", "serve", *serve, "--port", str(args.statelm_port)])
            start = functools.partial(start_server, serve, args.statelm_port)
            servers.append(Server(STATELM, args.statelm_port, shown, start))
        else:
            raise SystemExit(f"unknown server {label!r}: choose from {LLAMA},{STATELM}")
    return servers


async def workloads(server: Server, args: argparse.Namespace, levels: list[int]) -> dict[str, Any]:
    """Against one running server: calibrate the prompts, warm up, time TTFT, then every decode level."""
    target = make_target(server.label, f"http://127.0.0.1:{server.port}", None, True, args.timeout)
    target.model = (await target.client.models.list()).data[0].id
    decode_sentences, decode_prompt = await calibrate(target, args.prompt_tokens, False)
    ttft_sentences, ttft_prompt = await calibrate(target, args.ttft_prompt_tokens, False)
    ids = itertools.count(1)
    warm_id = next(ids)
    warm = await timed_request(target, warm_id, build_prompt(warm_id, decode_sentences, False), 8, args.timeout)
    if not warm.ok:
        raise SystemExit(f"{server.label}: warm-up request failed: {warm.error}")
    ttft_results = []
    for request_id in itertools.islice(ids, args.ttft_requests):
        prompt = build_prompt(request_id, ttft_sentences, False)
        ttft_results.append(await timed_request(target, request_id, prompt, 1, args.timeout))
    ttfts = [r.ttft_s for r in ttft_results if r.ok and r.ttft_s is not None]
    ttft_ms = statistics.median(ttfts) * 1000 if ttfts else None
    print(f"  TTFT ({ttft_prompt}-token prompt, median of {len(ttfts)}): {fmt(ttft_ms, 0)} ms", flush=True)
    follow_up = await follow_up_turn(target, decode_sentences, args, ids) if args.follow_up_tokens else None
    deadline = time.perf_counter() + args.max_duration
    summaries = []
    for concurrency in levels:
        requested = args.requests_per_level or concurrency * args.requests_per_stream
        summary = await run_level(target, concurrency, requested, decode_sentences, args, ids, deadline)
        summaries.append(summary)
        print(
            f"  concurrency {concurrency}: {summary['completed']}/{requested} ok in {summary['wall_s']:.1f} s, "
            f"{fmt(summary['output_tok_s'])} output tok/s, {fmt(summary['decode_tok_s_median'])} decode tok/s "
            f"per stream, TTFT p50 {fmt(summary['ttft_ms_p50'], 0)} ms",
            flush=True,
        )
        for message in summary["error_messages"]:
            print(f"    error: {message}")
    await target.client.close()
    return {
        "model": target.model,
        "decode_prompt_tokens": decode_prompt,
        "ttft_prompt_tokens": ttft_prompt,
        "ttft_ms": ttft_ms,
        "ttft_results": [asdict(r) for r in ttft_results],
        "follow_up": None if follow_up is None else asdict(follow_up),
        "levels": summaries,
    }


async def follow_up_turn(target: Target, sentences: int, args: argparse.Namespace, ids: Iterator[int]) -> RequestResult:
    """A stateless second turn, as an OpenAI client sends one: a first reply of --follow-up-tokens tokens, then the
    whole conversation again with a question (max_tokens 1); the second request's result."""
    first_id = next(ids)
    prompt = build_prompt(first_id, sentences, False)
    first = await timed_request(target, first_id, prompt, args.follow_up_tokens, args.timeout)
    history = [{"role": "user", "content": prompt}, {"role": "assistant", "content": first.text}]
    second = await timed_request(target, next(ids), FOLLOW_UP_QUESTION, 1, args.timeout, history)
    for result in (first, second):
        if not result.ok:
            print(f"  follow-up: a request failed: {result.error}", flush=True)
    ttft_ms = None if second.ttft_s is None else second.ttft_s * 1000
    print(
        f"  follow-up after a {first.completion_tokens}-token reply: TTFT {fmt(ttft_ms, 0)} ms, "
        f"{second.cached_tokens} of {second.prompt_tokens} prompt tokens cached",
        flush=True,
    )
    return second


def memory_mib(pid: int) -> dict[str, float]:
    """A process's resident memory now (`rss_mib`) and at its peak (`peak_rss_mib`), from /proc."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {key: int(fields[name].split()[0]) / 1024 for key, name in (("rss_mib", "VmRSS"), ("peak_rss_mib", "VmHWM"))}


def measure(server: Server, args: argparse.Namespace, levels: list[int]) -> dict[str, Any]:
    """Start one server alone, time its start-up, run the workloads, read its memory and stop it."""
    process, startup = server.start()
    print(f"{server.label}: up in {startup:.2f} s", flush=True)
    try:
        run = asyncio.run(workloads(server, args, levels))
        memory = memory_mib(process.pid)
        print(f"  RSS {memory['rss_mib']:.0f} MiB (peak {memory['peak_rss_mib']:.0f} MiB)", flush=True)
    finally:
        stop(process)
    return {"startup_s": startup, **run, **memory}


def usage_report(label: str, runs: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """Token counts the server reported in `usage`, and warnings where they differ from what was asked."""
    decode = [r for run in runs for level in run["levels"] for r in level["results"] if r["ok"]]
    ttft = [r for run in runs for r in run["ttft_results"] if r["ok"]]
    lines = [
        f"{label} usage: decode prompts {sorted({r['prompt_tokens'] for r in decode})} tokens "
        f"(cached {sorted({r['cached_tokens'] for r in decode})}), completions "
        f"{sorted({r['completion_tokens'] for r in decode})} (asked {args.output_tokens}); TTFT prompts "
        f"{sorted({r['prompt_tokens'] for r in ttft})} (cached {sorted({r['cached_tokens'] for r in ttft})}), "
        f"completions {sorted({r['completion_tokens'] for r in ttft})} (asked 1)"
    ]
    if not all(r["usage_reported"] for r in decode + ttft):
        lines.append(f"  WARNING: {label} sent no usage chunk for some streams; their counts are content chunks")
    if any(r["completion_tokens"] != args.output_tokens for r in decode) or any(
        r["completion_tokens"] != 1 for r in ttft
    ):
        lines.append(f"  WARNING: {label} generated other numbers of tokens than asked (ignore_eos not honoured?)")
    return lines


def level_figure(run: dict[str, Any], concurrency: int, key: str) -> float | None:
    """One figure of a run's decode level with that concurrency; None where the level did not run."""
    return next((level[key] for level in run["levels"] if level["concurrency"] == concurrency), None)


def metrics(levels: list[int], ttft_prompt_tokens: int) -> list[Metric]:
    """The table's rows: start-up, TTFT, then aggregate and per-stream decode rates per concurrency level."""
    rows = [
        Metric("start-up: launch to /health 200 (s)", False, lambda run: run["startup_s"]),
        Metric(f"TTFT, unique ≈{ttft_prompt_tokens}-token prompt, median (ms)", False, lambda run: run["ttft_ms"]),
        Metric("TTFT, stateless follow-up after a reply (ms)", False, follow_up_ttft_ms),
        Metric("RSS after the workloads (MiB)", False, lambda run: run.get("rss_mib")),
        Metric("peak RSS (MiB)", False, lambda run: run.get("peak_rss_mib")),
    ]
    for concurrency in levels:
        aggregate = functools.partial(level_figure, concurrency=concurrency, key="output_tok_s")
        per_stream = functools.partial(level_figure, concurrency=concurrency, key="decode_tok_s_median")
        rows.append(Metric(f"output tok/s, concurrency {concurrency} (aggregate)", True, aggregate))
        rows.append(Metric(f"decode tok/s per stream, concurrency {concurrency} (median, no TTFT)", True, per_stream))
    return rows


def follow_up_ttft_ms(run: dict[str, Any]) -> float | None:
    """The follow-up turn's time to first token, where it ran and answered."""
    follow_up = run.get("follow_up")
    return None if not follow_up or follow_up["ttft_s"] is None else follow_up["ttft_s"] * 1000


def pick(values: list[float], higher_is_better: bool, how: str) -> float | None:
    """The best (max or min) or the median of the rounds' values; None for none."""
    if not values:
        return None
    if how == "median":
        return statistics.median(values)
    return max(values) if higher_is_better else min(values)


def comparison(runs: dict[str, list[dict[str, Any]]], table_metrics: list[Metric], how: str) -> list[dict[str, Any]]:
    """One row per metric: each server's figure over the rounds and statelm / llama-server."""
    rows = []
    for metric in table_metrics:
        row: dict[str, Any] = {"metric": metric.name, "better": "higher" if metric.higher_is_better else "lower"}
        for label, server_runs in runs.items():
            values = [value for value in map(metric.read, server_runs) if value is not None]
            row[label] = pick(values, metric.higher_is_better, how)
        ours, theirs = row.get(STATELM), row.get(LLAMA)
        row["ratio"] = ours / theirs if ours is not None and theirs else None
        rows.append(row)
    return rows


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The comparison rows as a Markdown table."""
    lines = [
        f"| metric | better | {LLAMA} | {STATELM} | {STATELM} / {LLAMA} |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for row in rows:
        digits = 2 if "start" in row["metric"] else 1
        lines.append(
            f"| {row['metric']} | {row['better']} | {fmt(row.get(LLAMA), digits)} | {fmt(row.get(STATELM), digits)} "
            f"| {fmt(row['ratio'], 2)} |"
        )
    return "\n".join(lines)


def add_comparison_arguments(
    parser: argparse.ArgumentParser, concurrency: str, output_tokens: int, ttft_prompt_tokens: int
) -> None:
    """The flags of a statelm / llama-server comparison (this module's and bench.realsize's)."""
    parser.add_argument("--llama-server", type=Path, help="llama-server binary; default: the shared build script's")
    parser.add_argument("--servers", default=f"{LLAMA},{STATELM}", help="which to measure, comma-separated")
    parser.add_argument("--concurrency", default=concurrency, help="comma-separated decode levels (streams)")
    parser.add_argument(
        "--requests-per-level", type=int, help="a level's requests in all (default: streams × --requests-per-stream)"
    )
    parser.add_argument(
        "--requests-per-stream",
        type=int,
        default=3,
        help="requests each stream sends one after another (the per-stream decode rate is their median: one 64-token "
        "request, a second or two, swings with the host)",
    )
    parser.add_argument("--output-tokens", type=int, default=output_tokens, help="max_tokens of every decode stream")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="approximate prompt length of decode streams")
    parser.add_argument(
        "--ttft-prompt-tokens", type=int, default=ttft_prompt_tokens, help="approximate prompt length for TTFT"
    )
    parser.add_argument("--ttft-requests", type=int, default=5, help="TTFT requests (one at a time); median")
    parser.add_argument(
        "--follow-up-tokens",
        type=int,
        default=256,
        help="reply length before a stateless follow-up turn whose TTFT is timed (0: none); within the TTFT prompt"
        " plus output tokens, which size the slots",
    )
    parser.add_argument("--rounds", type=int, default=2, help="start/measure/stop each server this often")
    parser.add_argument("--pick", choices=("best", "median"), default="best", help="how rounds are combined")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="llama-server -t")
    parser.add_argument("--llama-port", type=int, default=8791)
    parser.add_argument("--statelm-port", type=int, default=8792)
    parser.add_argument("--llama-args", default="", help="extra llama-server flags")
    parser.add_argument("--statelm-args", default="", help="extra `statelm serve` flags")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per request")
    parser.add_argument("--max-duration", type=float, default=3600, help="seconds for one server's decode levels")
    parser.add_argument("--json", type=Path, help="write settings, the table and raw per-request results here")
    parser.set_defaults(shared_prefix=False)  # read by bench.throughput.run_level: every prompt starts unique


def per_stream(args: argparse.Namespace) -> str:
    """How many requests a stream sends, in words."""
    if args.requests_per_level:
        return f"{args.requests_per_level} requests a level"
    return f"{args.requests_per_stream} requests one after another"


def settings_line(args: argparse.Namespace, levels: list[int]) -> str:
    """What the workloads were, for a benchmark's header."""
    return (
        f"settings: decode {levels} streams × {per_stream(args)} × {args.output_tokens} output tokens (ignore_eos, "
        "greedy, streamed), "
        f"unique ≈{args.prompt_tokens}-token prompts; TTFT: median of {args.ttft_requests} unique "
        f"≈{args.ttft_prompt_tokens}-token prompts, max_tokens 1; follow-up: a stateless second turn after a "
        f"{args.follow_up_tokens}-token reply, max_tokens 1; {args.rounds} round(s), alternating order, "
        f"{args.pick} of the rounds"
    )


def alternate_rounds(servers: list[Server], args: argparse.Namespace, levels: list[int]) -> dict[str, list[Any]]:
    """Each server measured alone once per round, the order reversed every other round."""
    runs: dict[str, list[dict[str, Any]]] = {server.label: [] for server in servers}
    for round_index in range(args.rounds):
        print(f"\n== round {round_index + 1}/{args.rounds}", flush=True)
        for server in servers if round_index % 2 == 0 else servers[::-1]:
            runs[server.label].append(measure(server, args, levels))
    return runs


def print_comparison(
    runs: dict[str, list[Any]], args: argparse.Namespace, levels: list[int], first: tuple[Metric, ...] = ()
) -> list[dict[str, Any]]:
    """The servers' usage check and the comparison table (`first` rows, then metrics()), printed; returns its rows."""
    rows = comparison(runs, [*first, *metrics(levels, args.ttft_prompt_tokens)], args.pick)
    for label, server_runs in runs.items():
        print("\n".join(usage_report(label, server_runs, args)))
    print(f"\n{markdown_table(rows)}")
    print(f"\nratio: {STATELM} / {LLAMA}; above 1 is better for statelm where higher is better, below 1 where lower is")
    return rows


def write_json(path: Path, header: str, args: argparse.Namespace, payload: dict[str, Any]) -> None:
    """Settings, header and results as JSON."""
    settings = {k: str(value) if isinstance(value, Path) else value for k, value in vars(args).items()}
    path.write_text(json.dumps({"header": header, "settings": settings, **payload}, indent=2))
    print(f"\nraw results: {path}")


def main() -> None:
    """Parse the flags, measure each server alone over the rounds, and print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_comparison_arguments(parser, concurrency="1,4,16,64", output_tokens=128, ttft_prompt_tokens=512)
    args = parser.parse_args()
    levels = [int(level) for level in args.concurrency.split(",")]
    labels = args.servers.split(",")
    llama = find_llama_server(args.llama_server) if LLAMA in labels else None
    gguf = resolve_source("default").path
    servers = make_servers(args, llama, gguf, levels)
    peer = f"{llama} ({llama_version(llama)})" if llama is not None else "not measured"
    header = "\n".join(
        [
            machine_report(),
            f"llama-server: {peer}",
            f"gguf (statelm's --model default): {gguf}",
            *(f"{server.label}: {server.shown}" for server in servers),
            settings_line(args, levels),
            "start-up is timed with warm caches: each server was started and stopped once before the rounds",
        ]
    )
    print(header, flush=True)
    for server in servers:
        process, seconds = server.start()
        stop(process)
        print(f"{server.label}: warm-up start {seconds:.2f} s (not counted)", flush=True)
    runs = alternate_rounds(servers, args, levels)
    print(f"\n{header}")
    print(f"Command: `{shlex.join(['.venv/bin/python', '-m', 'bench.peers', *sys.argv[1:]])}`\n")
    rows = print_comparison(runs, args, levels)
    if args.json:
        write_json(args.json, header, args, {"table": rows, "runs": runs})


if __name__ == "__main__":
    main()
