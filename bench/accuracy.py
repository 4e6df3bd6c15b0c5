"""What packed weights and narrow KV caches cost in accuracy: next-token agreement and KL divergence.

Usage: .venv/bin/python -m bench.accuracy [--tokens 2000] [--compare weights|kv] [--windows 1]
weights: the reference is the default GGUF dequantized to float32 and run as a float model (every run with a
float16 KV cache). Each format runs through
statelm's quantized kernel twice: with float32 activations, and with activations quantized to int8 per 32
values as llama.cpp's CPU kernels do (`--activations`). `gguf` keeps the file's own blocks (Q4_1, and Q8_0
for the embedding), so with float32 activations only float rounding separates it from the reference; `int8`
and `int4`
re-quantize the float weights as a float checkpoint would be at load. Over a fixed text (the repository's
docs, the first N tokens), it reports the share of positions whose most likely next token matches the
reference's, and the mean KL(reference || format).
kv: the default model as the server runs it (its packed GGUF weights) with a float32 KV cache is the reference; the
same model with each narrower KV cache (float16, bfloat16, q8_0) runs the same text, over --windows stretches of
--tokens tokens spread over it. Every row is a prompt row, computed as the server computes prompt rows (float32
activations, the LM head's too). A second table runs every row with int8 activations (as generated tokens are
computed) over each KV format, against the same float32 reference: int8 rounding turns any small difference in its
inputs into a different rounding, so it shows whether a KV format adds to int8's own loss.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from bench.common import ROOT, machine_report
from statelm.config import EngineConfig
from statelm.engine.builder import create_engine, load_engine_model
from statelm.engine.scheduler import ScheduledChunk
from statelm.engine.sequence import SamplingParams, Sequence
from statelm.kernels.quant import PackedWeight, quantize
from statelm.models.compute_path import install_packed, use_activations, use_compute_path
from statelm.models.loader import LoadedModel

CHUNK = 256


def fixed_text() -> str:
    """The repository's README and docs, in a fixed order."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return "\n\n".join(Path(file).read_text() for file in files)


def all_logits(loaded: LoadedModel, tokens: list[int], kv: str = "float16") -> torch.Tensor:
    """Next-token logits [len(tokens), vocab] from a chunked prefill of the whole text over a KV cache of format kv."""
    config = EngineConfig(kv_cache_memory=1 << 30, enable_prefix_caching=False, kv_cache_dtype=kv)
    engine = create_engine(loaded, config)
    seq = Sequence("accuracy", tokens, SamplingParams(0.0), frozenset(), len(tokens) + 8)
    assert engine.kv.grow(seq.block_table, len(tokens))
    model, runner = loaded.model, engine.runner
    rows = []
    for start in range(0, len(tokens), CHUNK):
        count = min(CHUNK, len(tokens) - start)
        hidden = _hidden_of_chunk(runner, seq, count)
        rows.append(model.compute_logits(hidden, torch.ones(count, dtype=torch.bool)))  # prompt rows, as served
        seq.num_computed_tokens += count
    return torch.cat(rows)


def _hidden_of_chunk(runner: object, seq: Sequence, count: int) -> torch.Tensor:
    """Run one prefill chunk and return its hidden states for every row (not only the last)."""
    captured: list[torch.Tensor] = []
    model = runner.model  # type: ignore[attr-defined]
    hook = model.register_forward_hook(lambda _m, _i, output: captured.append(output))
    try:
        runner.execute([ScheduledChunk(seq, count)])  # type: ignore[attr-defined]
    finally:
        hook.remove()
    return captured[0]


def repack(loaded: LoadedModel, kind: str) -> None:
    """Re-quantize every linear (and the LM head) of a float model to kind (int8 or int4)."""
    model = loaded.model
    weights: dict[str, PackedWeight] = {}
    for name, (param, start, end) in model._targets.items():
        if param.dim() == 2 and name.endswith(".weight") and "norm" not in name:
            weights[name] = quantize(param.data[start:end].float(), kind)
    install_packed(model, weights)
    use_compute_path(model, "kernels")


def compare(reference: torch.Tensor, logits: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreement, mean KL(reference || logits)) over all positions."""
    agree = (reference.argmax(-1) == logits.argmax(-1)).float().mean().item()
    ref_logp, logp = reference.log_softmax(-1).double(), logits.log_softmax(-1).double()
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).mean().item()
    return agree, kl


def compare_kv_caches(tokens: int, windows: int) -> None:
    """Print the KV formats' tables: each narrower cache against float32 KV, the served model's weights in all."""
    with torch.inference_mode():
        served = load_engine_model(EngineConfig())
        text = served.tokenizer.encode(fixed_text())
        create_engine(served, EngineConfig(kv_cache_memory=64 << 20))  # runs the self-check, picks a path
        step = (len(text) - tokens) // max(1, windows - 1)
        stretches = [text[index * step : index * step + tokens] for index in range(windows)]
        print(f"text: {windows} stretches of {tokens} tokens spread over the {len(text)} of README.md + docs/*.md; "
              f"the default model as served, compute path {served.model.compute_path}; reference: float32 KV cache, "
              "float32 activations (as prompt rows are computed)")  # fmt: skip
        results: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for stretch in stretches:
            served.model.use_activations("float32")
            reference = all_logits(served, stretch, "float32")
            for kv in ("float16", "bfloat16", "q8_0"):
                results.setdefault(("float32", kv), []).append(compare(reference, all_logits(served, stretch, kv)))
            served.model.use_activations("int8")
            for kv in ("float32", "float16", "bfloat16", "q8_0"):
                results.setdefault(("int8", kv), []).append(compare(reference, all_logits(served, stretch, kv)))
    print("| activations | KV cache | top-1 agreement | per stretch | mean KL divergence (nats) |")
    print("| --- | --- | ---: | --- | ---: |")
    for (activations, kv), rows in results.items():
        agree, kl = statistics.mean(row[0] for row in rows), statistics.mean(row[1] for row in rows)
        spread = ", ".join(f"{row[0]:.2%}" for row in rows)
        print(f"| {activations} | {kv} | {agree:.2%} | {spread} | {kl:.2e} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--compare", choices=["weights", "kv"], default="weights")
    parser.add_argument("--windows", type=int, default=1, help="kv: stretches of --tokens spread over the text")
    args = parser.parse_args()
    print(machine_report())
    if args.compare == "kv":
        compare_kv_caches(args.tokens, args.windows)
        return
    with torch.inference_mode():
        float_model = load_engine_model(EngineConfig(quantization="none"))
        tokens = float_model.tokenizer.encode(fixed_text())[: args.tokens]
        print(f"text: {len(tokens)} tokens of README.md + docs/*.md; reference: float32 weights and activations")
        create_engine(float_model, EngineConfig(kv_cache_memory=64 << 20))  # runs the self-check, picks a path
        print(f"reference compute path: {float_model.model.compute_path}")
        reference = all_logits(float_model, tokens)
        results = {}
        for activations in ("float32", "int8"):
            packed = load_engine_model(EngineConfig(quantization="auto", activations=activations))
            create_engine(packed, EngineConfig(kv_cache_memory=64 << 20))
            results["gguf (Q4_1 + Q8_0 blocks as stored)", activations] = compare(reference, all_logits(packed, tokens))
            for kind in ("int8", "int4"):
                requantized = load_engine_model(EngineConfig(quantization="none"))
                repack(requantized, kind)
                use_activations(requantized.model, activations)
                results[f"{kind} (re-quantized at load)", activations] = compare(
                    reference, all_logits(requantized, tokens)
                )
    print("| format | activations | top-1 agreement | mean KL divergence (nats) |")
    print("| --- | --- | ---: | ---: |")
    for (name, activations), (agree, kl) in results.items():
        print(f"| {name} | {activations} | {agree:.2%} | {kl:.5f} |")


if __name__ == "__main__":
    main()
