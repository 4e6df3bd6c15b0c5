"""Single-stream latency: server start-up, prefill of a long prompt, decode speed of one stream.

Usage: .venv/bin/python -m bench.latency [--url URL] [--prompt-tokens 512] [--output-tokens 128]
Without --url it starts `statelm serve --model default` itself and also reports the start-up time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import httpx

from bench.common import machine_report, server_for


def filler_prompt(approx_tokens: int) -> str:
    """A user message of roughly approx_tokens tokens (about 5 tokens per sentence below)."""
    sentence = "The river runs past the old mill. "
    return sentence * max(1, approx_tokens // 8)


def timed_stream(url: str, model: str, prompt: str, max_tokens: int) -> dict[str, float]:
    """Stream one greedy completion; return TTFT, decode rate and token counts."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    arrivals: list[float] = []
    usage: dict[str, int] = {}
    started = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                arrivals.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "ttft_s": arrivals[0] - started,
        "decode_tok_s": (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]),
        "median_itl_ms": statistics.median(gaps) * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an already running server; default: start one on the default model")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--serve-args", default="", help="extra `statelm serve` flags when starting one")
    args = parser.parse_args()
    print(machine_report())
    with server_for(args.url, args.port, args.serve_args) as target:
        url = target.url
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        timed_stream(url, model, "Hello", 8)  # warm-up
        print(f"settings: prompt ≈{args.prompt_tokens} tokens, {args.output_tokens} output tokens, greedy")
        for run in range(args.runs):
            # a different opening word per run keeps the prefix cache from serving the prompt
            result = timed_stream(url, model, f"Run {run}. " + filler_prompt(args.prompt_tokens), 16)
            prefill = result["prompt_tokens"] / result["ttft_s"]
            print(
                f"prefill: {result['prompt_tokens']} prompt tokens, TTFT {result['ttft_s'] * 1000:.0f} ms "
                f"({prefill:.0f} tok/s)"
            )
        for _ in range(args.runs):
            result = timed_stream(url, model, "Tell me a long story about a dragon.", args.output_tokens)
            print(
                f"decode: {result['completion_tokens']} tokens at {result['decode_tok_s']:.1f} tok/s, "
                f"median inter-token {result['median_itl_ms']:.1f} ms"
            )


if __name__ == "__main__":
    main()
