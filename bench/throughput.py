"""Throughput under concurrent load: aggregate output tokens/s, per-stream decode, TTFT, inter-token latency.

Usage: .venv/bin/python -m bench.throughput [--url URL] [--model NAME] [--concurrency 1,4,16,64]
           [--prompt-tokens 256] [--output-tokens 128] [--requests-per-level N] [--shared-prefix]
           [--peer-url URL [--peer-model NAME]] [--no-ignore-eos] [--json PATH]
Without --url it starts `statelm serve --model default` itself and also reports the start-up time.
Any OpenAI-compatible server works as --url or --peer-url (e.g. llama.cpp's llama-server); pass
--no-ignore-eos (--peer-no-ignore-eos) for one that rejects the `ignore_eos` field.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import shlex
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from bench.common import machine_report, server_for

SENTENCE = "The river runs past the old mill. "


@dataclass
class Target:
    """One server under test."""

    label: str
    url: str
    model: str
    ignore_eos: bool
    client: openai.AsyncOpenAI


@dataclass
class RequestResult:
    """Timings and token counts of one streamed request."""

    request_id: int
    ok: bool
    error: str = ""
    latency_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    usage_reported: bool = False
    ttft_s: float | None = None
    decode_tok_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    text: str = ""  # the reply


def build_prompt(request_id: int, sentences: int, shared_prefix: bool) -> str:
    """The user message: filler led by the request's id, or ending with it under --shared-prefix."""
    filler = SENTENCE * sentences
    return f"{filler}(Request {request_id}.)" if shared_prefix else f"Request {request_id}: {filler}"


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0 to 100), linearly interpolated; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def fmt(value: float | None, digits: int = 1) -> str:
    """A number for the tables, or an en dash when there is none."""
    return "–" if value is None else f"{value:.{digits}f}"


async def count_prompt_tokens(target: Target, text: str) -> int:
    """The prompt_tokens a target reports for a one-message conversation (one token generated)."""
    response = await target.client.chat.completions.create(
        model=target.model, messages=[{"role": "user", "content": text}], max_tokens=1, temperature=0
    )
    if response.usage is None:
        raise SystemExit(f"{target.label}: the response carries no usage; cannot calibrate the prompt length")
    return response.usage.prompt_tokens


async def calibrate(target: Target, prompt_tokens: int, shared_prefix: bool) -> tuple[int, int]:
    """Filler sentences that make the prompt about prompt_tokens long, and the length then measured."""
    probe = max(1, prompt_tokens // 8)
    one = await count_prompt_tokens(target, build_prompt(0, 1, shared_prefix))
    more = await count_prompt_tokens(target, build_prompt(0, 1 + probe, shared_prefix))
    per_sentence = max(1e-9, (more - one) / probe)
    sentences = max(1, 1 + round((prompt_tokens - one) / per_sentence))
    return sentences, await count_prompt_tokens(target, build_prompt(0, sentences, shared_prefix))


async def timed_request(
    target: Target,
    request_id: int,
    prompt: str,
    max_tokens: int,
    timeout: float,
    history: list[dict[str, str]] | None = None,
    temperature: float = 0.0,
) -> RequestResult:
    """Stream one completion of prompt (a user message after the messages of history), greedy unless a temperature
    is given (then seeded with the request id); time the content chunks, keep the reply's text and read the usage
    chunk."""
    result = RequestResult(request_id=request_id, ok=False)
    arrivals: list[float] = []
    usage = None
    started = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            stream = await target.client.chat.completions.create(
                model=target.model,
                messages=[*(history or []), {"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                temperature=temperature,
                seed=request_id if temperature else openai.NOT_GIVEN,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True} if target.ignore_eos else None,
            )
            async with stream:
                async for chunk in stream:
                    if chunk.usage is not None:
                        usage = chunk.usage
                    if chunk.choices and chunk.choices[0].delta.content:
                        arrivals.append(time.perf_counter())
                        result.text += chunk.choices[0].delta.content
    except (openai.OpenAIError, httpx.HTTPError, TimeoutError) as error:
        reason = str(error) or f"no complete reply within {timeout:.0f} s"
        result.error = f"{type(error).__name__}: {reason}"[:300]
        result.latency_s = time.perf_counter() - started
        return result
    result.ok = True
    result.latency_s = time.perf_counter() - started
    if usage is not None:
        result.usage_reported = True
        result.prompt_tokens = usage.prompt_tokens
        result.completion_tokens = usage.completion_tokens
        details = usage.prompt_tokens_details
        result.cached_tokens = (details.cached_tokens or 0) if details is not None else 0
    else:  # no usage chunk: one token per content chunk is the best estimate
        result.completion_tokens = len(arrivals)
    if arrivals:
        result.ttft_s = arrivals[0] - started
        result.gaps_s = [b - a for a, b in itertools.pairwise(arrivals)]
    if len(arrivals) >= 2 and arrivals[-1] > arrivals[0]:
        result.decode_tok_s = (result.completion_tokens - 1) / (arrivals[-1] - arrivals[0])
    return result


def summarize(concurrency: int, requested: int, results: list[RequestResult], wall_s: float) -> dict[str, Any]:
    """The per-level figures: counts, aggregate tokens/s and TTFT / inter-token percentiles."""
    done = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    gaps = [gap for r in done for gap in r.gaps_s]
    decode = [r.decode_tok_s for r in done if r.decode_tok_s is not None]
    completion = sum(r.completion_tokens for r in done)
    summary: dict[str, Any] = {
        "concurrency": concurrency,
        "requests": requested,
        "completed": len(done),
        "errors": len(results) - len(done),
        "skipped": requested - len(results),
        "wall_s": wall_s,
        "completion_tokens": completion,
        "output_tok_s": completion / wall_s if wall_s > 0 else None,
        "prompt_tokens_mean": statistics.fmean([r.prompt_tokens for r in done]) if done else None,
        "cached_tokens_mean": statistics.fmean([r.cached_tokens for r in done]) if done else None,
        "completion_tokens_mean": completion / len(done) if done else None,
        "usage_reported": all(r.usage_reported for r in done),
        "decode_tok_s_median": statistics.median(decode) if decode else None,
        "error_messages": sorted({r.error for r in results if not r.ok})[:5],
        "results": [asdict(r) for r in results],
    }
    for name, values in (("ttft_ms", ttfts), ("itl_ms", gaps)):
        for q in (50, 90, 99):
            value = percentile(values, q)
            summary[f"{name}_p{q}"] = None if value is None else value * 1000
    return summary


async def run_level(
    target: Target,
    concurrency: int,
    requested: int,
    sentences: int,
    args: argparse.Namespace,
    ids: Iterator[int],
    deadline: float,
) -> dict[str, Any]:
    """Send `requested` requests with at most `concurrency` in flight; summarize them."""
    semaphore = asyncio.Semaphore(concurrency)

    async def one(request_id: int) -> RequestResult | None:
        """One request once a slot is free; None when the total time guard has run out."""
        async with semaphore:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return None
            prompt = build_prompt(request_id, sentences, args.shared_prefix)
            return await timed_request(target, request_id, prompt, args.output_tokens, min(args.timeout, remaining))

    started = time.perf_counter()
    outcomes = await asyncio.gather(*(one(next(ids)) for _ in range(requested)))
    wall_s = time.perf_counter() - started
    return summarize(concurrency, requested, [r for r in outcomes if r is not None], wall_s)


async def bench_target(target: Target, levels: list[int], args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """Calibrate the prompt, warm up, then run every concurrency level against one target."""
    if not target.model:
        target.model = (await target.client.models.list()).data[0].id
    print(f"\n== {target.label}: {target.url}, model {target.model}, ignore_eos {target.ignore_eos}")
    sentences, measured = await calibrate(target, args.prompt_tokens, args.shared_prefix)
    print(f"prompt: {sentences} filler sentences -> {measured} prompt tokens (asked for ≈{args.prompt_tokens})")
    ids = itertools.count(1)
    warm_id = next(ids)
    prompt = build_prompt(warm_id, sentences, args.shared_prefix)
    warm = await timed_request(target, warm_id, prompt, args.output_tokens, args.timeout)
    outcome = "ok" if warm.ok else warm.error
    print(f"warm-up: {outcome}, {warm.completion_tokens} tokens in {warm.latency_s:.1f} s")
    summaries = []
    for concurrency in levels:
        requested = args.requests_per_level or max(2 * concurrency, 8)
        summary = await run_level(target, concurrency, requested, sentences, args, ids, deadline)
        summaries.append(summary)
        print(
            f"concurrency {concurrency}: {summary['completed']}/{requested} ok, {summary['errors']} errors, "
            f"{summary['skipped']} skipped, {summary['wall_s']:.1f} s, "
            f"{fmt(summary['output_tok_s'])} output tok/s, TTFT p50 {fmt(summary['ttft_ms_p50'], 0)} ms, "
            f"ITL p50 {fmt(summary['itl_ms_p50'])} ms"
        )
        for message in summary["error_messages"]:
            print(f"  error: {message}")
        if summary["skipped"]:
            print(f"  total time guard (--max-duration {args.max_duration:.0f} s) reached; stopping")
            break
    await target.client.close()
    return {
        "label": target.label,
        "url": target.url,
        "model": target.model,
        "ignore_eos": target.ignore_eos,
        "filler_sentences": sentences,
        "prompt_tokens": measured,
        "levels": summaries,
    }


def markdown_table(report: dict[str, Any]) -> str:
    """One target's levels as a Markdown table."""
    lines = [
        "| concurrency | requests | errors | wall (s) | output tok/s | decode tok/s per request (median) "
        "| prompt / cached tokens (mean) | TTFT p50 / p90 / p99 (ms) | inter-token p50 / p90 / p99 (ms) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in report["levels"]:
        ttft = " / ".join(fmt(s[f"ttft_ms_p{q}"], 0) for q in (50, 90, 99))
        itl = " / ".join(fmt(s[f"itl_ms_p{q}"]) for q in (50, 90, 99))
        tokens = f"{fmt(s['prompt_tokens_mean'], 0)} / {fmt(s['cached_tokens_mean'], 0)}"
        lines.append(
            f"| {s['concurrency']} | {s['completed']}/{s['requests']} | {s['errors']} "
            f"| {s['wall_s']:.1f} | {fmt(s['output_tok_s'])} | {fmt(s['decode_tok_s_median'])} | {tokens} "
            f"| {ttft} | {itl} |"
        )
    return "\n".join(lines)


def comparison_table(first: dict[str, Any], second: dict[str, Any]) -> str:
    """Both targets side by side: output tok/s and TTFT p50 per concurrency level."""
    a, b = first["label"], second["label"]
    lines = [
        f"| concurrency | {a} output tok/s | {b} output tok/s | {a} / {b} | {a} TTFT p50 (ms) | {b} TTFT p50 (ms) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    peer_levels = {s["concurrency"]: s for s in second["levels"]}
    for s in first["levels"]:
        p = peer_levels.get(s["concurrency"])
        ours, theirs = s["output_tok_s"], p and p["output_tok_s"]
        ratio = ours / theirs if ours is not None and theirs else None
        ttfts = f"{fmt(s['ttft_ms_p50'], 0)} | {fmt(p and p['ttft_ms_p50'], 0)}"
        lines.append(f"| {s['concurrency']} | {fmt(ours)} | {fmt(theirs)} | {fmt(ratio, 2)} | {ttfts} |")
    return "\n".join(lines)


def make_target(label: str, url: str, model: str | None, ignore_eos: bool, timeout: float) -> Target:
    """A target with its own client: no retries, so a failure counts as an error, and a connection a request.

    No connection is kept between requests: llama-server (cpp-httplib) closes one idle for 5 s, which a request sent
    on it as it closes meets as a connection error (the likely cause of one llama-server request in three failing
    now and then). A local connection costs well under a millisecond, beside first tokens of tens of milliseconds or
    more, and both servers pay it.
    """
    if not url.startswith(("http://", "https://")):
        raise SystemExit(f"not an http(s) URL: {url}")
    url = url.rstrip("/")
    http_client = openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_keepalive_connections=0))
    client = openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="none", timeout=timeout, max_retries=0, http_client=http_client
    )
    return Target(label, url, model or "", ignore_eos, client)


async def run_all(targets: list[Target], levels: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Benchmark the targets one after the other under one total time guard."""
    deadline = time.perf_counter() + args.max_duration
    return [await bench_target(target, levels, args, deadline) for target in targets]


def main() -> None:
    """Parse the flags, start a server if needed, run the levels and print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an already running server; default: start one on the default model")
    parser.add_argument("--model", help="model name to request; default: the first id of GET /v1/models")
    parser.add_argument("--label", default="statelm", help="name of --url's server in the tables")
    parser.add_argument("--port", type=int, default=8765, help="port of the server started without --url")
    parser.add_argument("--serve-args", default="", help="extra `statelm serve` flags when starting one")
    parser.add_argument("--peer-url", help="an OpenAI-compatible peer to run the same levels against")
    parser.add_argument("--peer-model", help="model name for the peer; default: its first /v1/models id")
    parser.add_argument("--peer-label", default="peer", help="name of the peer in the tables")
    parser.add_argument("--concurrency", default="1,4,16,64", help="comma-separated levels")
    parser.add_argument("--requests-per-level", type=int, help="default: max(2 × concurrency, 8)")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="approximate prompt length")
    parser.add_argument("--output-tokens", type=int, default=128, help="max_tokens of every request")
    parser.add_argument(
        "--shared-prefix",
        action="store_true",
        help="common filler first, request id last (measures prefix caching)",
    )
    parser.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos to --url")
    parser.add_argument("--peer-no-ignore-eos", action="store_true", help="same for --peer-url")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per request")
    parser.add_argument("--max-duration", type=float, default=3600, help="seconds for the whole run")
    parser.add_argument("--json", type=Path, help="write settings and raw per-request results here")
    args = parser.parse_args()
    levels = [int(level) for level in args.concurrency.split(",")]
    machine = machine_report()
    print(machine)
    prompt_kind = "shared prefix, request id at the end" if args.shared_prefix else "unique start per request"
    print(
        f"settings: concurrency {levels}, prompt ≈{args.prompt_tokens} tokens ({prompt_kind}), "
        f"{args.output_tokens} output tokens, greedy, streaming, timeout {args.timeout:.0f} s per request"
    )
    with server_for(args.url, args.port, args.serve_args) as server:
        startup = server.startup_s
        targets = [make_target(args.label, server.url, args.model, not args.no_ignore_eos, args.timeout)]
        if args.peer_url:
            peer_eos = not args.peer_no_ignore_eos
            targets.append(make_target(args.peer_label, args.peer_url, args.peer_model, peer_eos, args.timeout))
        reports = asyncio.run(run_all(targets, levels, args))
    print(f"\n{machine}")
    print(
        f"Command: `{shlex.join(['.venv/bin/python', '-m', 'bench.throughput', *sys.argv[1:]])}`\n"
        f"Settings: prompt ≈{args.prompt_tokens} tokens "
        f"({prompt_kind}), {args.output_tokens} output tokens, greedy"
    )
    for report in reports:
        print(f"\n{report['label']} ({report['model']}, {report['prompt_tokens']} prompt tokens):\n")
        print(markdown_table(report))
    if len(reports) == 2:
        print(f"\n{reports[0]['label']} vs {reports[1]['label']}:\n")
        print(comparison_table(reports[0], reports[1]))
    if args.json:
        settings = {k: str(value) if isinstance(value, Path) else value for k, value in vars(args).items()}
        payload = {"machine": machine, "settings": settings, "startup_s": startup, "targets": reports}
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"\nraw results: {args.json}")


if __name__ == "__main__":
    main()
