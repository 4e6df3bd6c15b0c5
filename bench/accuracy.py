"""What packed weights cost in accuracy: next-token agreement and KL divergence against the float model.

Usage: .venv/bin/python -m bench.accuracy [--tokens 2000]
The reference is the default GGUF dequantized to float32 and run as a float model. Each format runs through
statelm's quantized kernel twice: with float32 activations, and with activations quantized to int8 per 32
values as llama.cpp's CPU kernels do (`--activations`). `gguf` keeps the file's own blocks (Q4_1, and Q8_0
for the embedding), so with float32 activations only float rounding separates it from the reference; `int8`
and `int4`
re-quantize the float weights as a float checkpoint would be at load. Over a fixed text (the repository's
docs, the first N tokens), it reports the share of positions whose most likely next token matches the
reference's, and the mean KL(reference || format).
"""

from __future__ import annotations

import argparse
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


def all_logits(loaded: LoadedModel, tokens: list[int]) -> torch.Tensor:
    """Next-token logits [len(tokens), vocab] from a chunked prefill of the whole text."""
    engine = create_engine(loaded, EngineConfig(kv_cache_memory=1 << 30, enable_prefix_caching=False))
    seq = Sequence("accuracy", tokens, SamplingParams(0.0), frozenset(), len(tokens) + 8)
    assert engine.kv.grow(seq.block_table, len(tokens))
    model, runner = loaded.model, engine.runner
    rows = []
    for start in range(0, len(tokens), CHUNK):
        count = min(CHUNK, len(tokens) - start)
        hidden = _hidden_of_chunk(runner, seq, count)
        rows.append(model.compute_logits(hidden))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000)
    args = parser.parse_args()
    print(machine_report())
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
