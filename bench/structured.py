"""What constrained decoding costs: the engine's decode step with and without a grammar, and the mask alone.

Usage: .venv/bin/python -m bench.structured [--choices 1,8] [--steps 32] [--runs 3] [--dtype bfloat16]
In-process on the default model: one request of `n` choices (every row masked by its own matcher),
sampled at temperature 1 with seed 0, its decode steps timed one by one (median over the runs). Modes:
no constraint, a JSON schema, a regex, and the forced tool-call list. Then the llguidance mask alone
(compute + apply to one logits row) along a valid output of each constraint.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.common import machine_report
from statelm.api.structured_output import forced_tool_constraint
from statelm.config import EngineConfig
from statelm.engine.builder import create_engine
from statelm.engine.grammar import CompiledGrammar, GrammarBackend, GrammarMatcher
from statelm.engine.sequence import SamplingParams
from statelm.models.loader import LoadedModel, load_model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "hobbies"],
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}
PROMPT = "Describe a person who likes hiking, as JSON."
# A valid output of each constraint, to walk the mask along
SAMPLES = {
    "json_schema": json.dumps({"name": "Alice Smith", "age": 31, "hobbies": ["hiking", "climbing", "reading books"]}),
    "regex": "the quick brown fox jumps over the lazy dog, again and again.",
    "tool_call": json.dumps([{"name": "search", "arguments": {"query": "hiking boots for rocky trails"}}]),
}


def grammars(backend: GrammarBackend) -> dict[str, CompiledGrammar | None]:
    """The constraints measured, compiled."""
    tool = forced_tool_constraint([SEARCH_TOOL], "required", parallel=True)
    return {
        "none": None,
        "json_schema": backend.compile("json_schema", PERSON),
        "regex": backend.compile("regex", "[a-z ,.]+"),
        "tool_call": backend.compile(tool.kind, tool.spec),
    }


def decode_steps_ms(loaded: LoadedModel, prompt: list[int], params: SamplingParams) -> list[float]:
    """The wall time of each decode step of one request, in ms (its prefill step excluded; one token a step)."""
    engine = create_engine(loaded, EngineConfig(kv_cache_memory=256 << 20, speculative_tokens=0))
    engine.add_request("bench", prompt, params)
    engine.step()
    steps = []
    while engine.scheduler.has_work():  # the request's steps, not the idle engine's (a reply's refresh)
        started = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - started) * 1000)
    return steps


def mask_ms(grammar: CompiledGrammar, token_ids: list[int], vocab: int) -> list[float]:
    """Time (ms) to compute and apply the mask before each token of a valid output."""
    matcher = GrammarMatcher(grammar)
    logits = torch.zeros(vocab)
    times = []
    for token_id in token_ids:
        started = time.perf_counter()
        matcher.fill_mask(logits)
        times.append((time.perf_counter() - started) * 1000)
        matcher.accept(token_id)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--choices", default="1,8", help="batch sizes (n) to measure")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per request (max_tokens)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    print(machine_report())
    print(f"settings: default model, {args.dtype}, temperature 1, seed 0, {args.steps} decode steps, runs {args.runs}")
    loaded = load_model("default", torch.device("cpu"), getattr(torch, args.dtype))
    tokenizer = loaded.tokenizer
    backend = GrammarBackend(tokenizer)
    compiled = grammars(backend)
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]))
    for choices in (int(value) for value in args.choices.split(",")):
        baseline = None
        for name, grammar in compiled.items():
            params = SamplingParams(temperature=1.0, seed=0, n=choices, max_tokens=args.steps, grammar=grammar)
            step = statistics.median(ms for _ in range(args.runs) for ms in decode_steps_ms(loaded, prompt, params))
            baseline = baseline or step
            print(
                f"n={choices:<3} {name:<12} decode step {step:6.1f} ms ({(step / baseline - 1) * 100:+5.1f}% vs none)"
            )
    for name, text in SAMPLES.items():
        grammar = compiled[name]
        assert grammar is not None
        times = sorted(mask_ms(grammar, tokenizer.encode(text), backend.vocab_size))
        print(
            f"mask {name:<12} per row: median {statistics.median(times):.2f} ms, "
            f"p90 {times[int(len(times) * 0.9)]:.2f} ms, max {times[-1]:.2f} ms over {len(times)} tokens"
        )


if __name__ == "__main__":
    main()
