"""What packed weights and narrow KV caches cost in accuracy: next-token agreement and KL divergence.

Usage: .venv/bin/python -m bench.accuracy [--tokens 2000] [--compare weights|kv] [--windows 1]
                                           [--model default|FILE.gguf] [--requantize int8,int4] [--llama-cpp]
weights: the reference is the GGUF (the bundled model unless --model names one) dequantized to float32, gguf-py's
values exactly, and run as a float model (every run with a float16 KV cache). Each format runs through statelm's
quantized kernel in each arithmetic a prompt row can take (`--activations`): float32 activations, activations
quantized to int16 per 32 values (`int16-prompt`), and to int8 per 32 values as llama.cpp's CPU kernels do. `gguf`
keeps the file's own blocks (the bundled model: Q4_1, and Q8_0 for the embedding), so with float32 activations only
float rounding separates it from the reference; `int8` and `int4` (--requantize; empty: none) re-quantize the float
weights (Q8_0 and Q4_1 blocks) as a float checkpoint would be at load. Over a fixed text (the repository's docs, the
first N tokens), fed as prompt rows, it reports the share of positions whose most likely next token matches the
reference's (each position's next token is what a prompt ending there would answer first) and the mean
KL(reference || format); --llama-cpp adds llama.cpp's own next token at each position on the same file.
kv: the default model as the server runs it (its packed GGUF weights) with a float32 KV cache is the reference; the
same model with each narrower KV cache (float16, bfloat16, q8_0) runs the same text, over --windows stretches of
--tokens tokens spread over it. Every row is a prompt row with float32 activations (the LM head's too). A second
table runs every row with int8 activations (as generated tokens are computed) over each KV format, against the same
float32 reference: int8 rounding turns any small difference in its inputs into a different rounding, so it shows
whether a KV format adds to int8's own loss.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from bench.common import ROOT, machine_report
from bench.peers import build_with_libllama, find_llama_server, llama_version
from statelm.config import EngineConfig
from statelm.engine.builder import create_engine, load_engine_model
from statelm.engine.scheduler import ScheduledChunk
from statelm.engine.sequence import SamplingParams, Sequence
from statelm.kernels.quant import PackedWeight, quantize
from statelm.models.compute_path import install_packed, use_activations, use_compute_path
from statelm.models.loader import LoadedModel, resolve_source
from statelm.models.packed import ACTIVATIONS, PackedEmbedding, PackedLinear

CHUNK = 256
# llama.cpp's own next-token choice at every position of a token sequence (its CPU arithmetic on the same file).
LLAMA_TOP1 = r"""
#include "llama.h"
#include <stdio.h>
#include <stdlib.h>
static void quiet(enum ggml_log_level level, const char * text, void * data) { (void) level; (void) text; (void) data; }
int main(int argc, char ** argv) {
    if (argc != 4) { fprintf(stderr, "usage: top1 MODEL IDS THREADS\n"); return 2; }
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    FILE * file = fopen(argv[2], "rb");
    fseek(file, 0, SEEK_END); long n = ftell(file) / 4; fseek(file, 0, SEEK_SET);
    int32_t * ids = malloc(4 * n);
    if (fread(ids, 4, n, file) != (size_t) n) return 1;
    struct llama_context_params params = llama_context_default_params();
    params.n_ctx = n + 256; params.n_batch = 512; params.n_ubatch = 512;
    params.n_threads = params.n_threads_batch = atoi(argv[3]);
    struct llama_context * ctx = llama_init_from_model(model, params);
    int32_t vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    struct llama_batch batch = llama_batch_init(512, 0, 1);
    for (long start = 0; start < n; start += 512) {
        batch.n_tokens = n - start < 512 ? n - start : 512;
        for (int i = 0; i < batch.n_tokens; i++) {
            batch.token[i] = ids[start + i]; batch.pos[i] = start + i;
            batch.n_seq_id[i] = 1; batch.seq_id[i][0] = 0; batch.logits[i] = 1;
        }
        if (llama_decode(ctx, batch)) { fprintf(stderr, "llama_decode failed\n"); return 1; }
        for (int i = 0; i < batch.n_tokens; i++) {
            const float * logits = llama_get_logits_ith(ctx, i);
            int best = 0;
            for (int v = 1; v < vocab; v++) if (logits[v] > logits[best]) best = v;
            printf("%d\n", best);
        }
    }
    return 0;
}
"""


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
        rows.append(model.compute_logits(hidden, torch.ones(count, dtype=torch.bool)))  # prompt rows' logits
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


def llama_cpp_top1(llama_server: Path, model: Path, tokens: list[int]) -> torch.Tensor:
    """llama.cpp's most likely next token at each position of tokens (libllama of llama-server's build)."""
    with tempfile.TemporaryDirectory() as work:
        program = build_with_libllama(llama_server, LLAMA_TOP1, Path(work) / "top1")
        ids = Path(work) / "ids"
        ids.write_bytes(torch.tensor(tokens, dtype=torch.int32).numpy().tobytes())
        threads = str(len(os.sched_getaffinity(0)))
        done = subprocess.run([str(program), str(model), str(ids), threads], capture_output=True, text=True, check=True)
    return torch.tensor([int(line) for line in done.stdout.split()])


def block_formats(loaded: LoadedModel) -> list[str]:
    """The block formats of the model's packed layers, in name order."""
    layers = [m for m in loaded.model.modules() if isinstance(m, PackedLinear | PackedEmbedding)]
    return sorted({part.qtype.name for layer in layers for part in layer.weight.parts})


def scores(reference: torch.Tensor, logits: torch.Tensor) -> tuple[float, float, torch.Tensor]:
    """compare()'s figures and the most likely next token at each position."""
    return (*compare(reference, logits), logits.argmax(-1))


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
              "float32 activations (--activations float32)")  # fmt: skip
        results: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for stretch in stretches:
            use_activations(served.model, "float32")
            reference = all_logits(served, stretch, "float32")
            for kv in ("float16", "bfloat16", "q8_0"):
                results.setdefault(("float32", kv), []).append(compare(reference, all_logits(served, stretch, kv)))
            use_activations(served.model, "int8")
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
    parser.add_argument("--model", default="default", help="a GGUF file, or `default` (the bundled model)")
    parser.add_argument("--requantize", default="int8,int4", help="float re-quantizations to compare too (or '')")
    parser.add_argument("--llama-cpp", action="store_true", help="llama.cpp's own next tokens on the file too")
    parser.add_argument("--llama-server", type=Path, help="whose libllama --llama-cpp uses (default: bench.peers')")
    args = parser.parse_args()
    kinds = [kind for kind in args.requantize.split(",") if kind]
    print(machine_report())
    if args.compare == "kv":
        compare_kv_caches(args.tokens, args.windows)
        return
    with torch.inference_mode():
        float_model = load_engine_model(EngineConfig(model=args.model, quantization="none", dtype="float32"))
        tokens = float_model.tokenizer.encode(fixed_text())[: args.tokens]
        print(f"model: {args.model}; text: {len(tokens)} tokens of README.md + docs/*.md; reference: float32 weights")
        create_engine(float_model, EngineConfig(kv_cache_memory=64 << 20))  # runs the self-check, picks a path
        print(f"reference compute path: {float_model.model.compute_path}")
        reference = all_logits(float_model, tokens)
        results = {}
        for activations in ("float32", "int16-prompt", "int8"):
            arithmetic = ACTIVATIONS[activations][0]  # of prompt rows, which this text is
            packed = load_engine_model(EngineConfig(model=args.model, quantization="auto", activations=activations))
            create_engine(packed, EngineConfig(kv_cache_memory=64 << 20))
            name = f"gguf ({' + '.join(block_formats(packed))} blocks as stored)"
            results[name, arithmetic] = scores(reference, all_logits(packed, tokens))
            del packed
            for kind in kinds:
                requantized = load_engine_model(EngineConfig(model=args.model, quantization="none", dtype="float32"))
                repack(requantized, kind)
                use_activations(requantized.model, activations)
                results[f"{kind} (re-quantized at load)", arithmetic] = scores(
                    reference, all_logits(requantized, tokens)
                )
    llama_top1 = None
    if args.llama_cpp:
        llama_server = find_llama_server(args.llama_server)
        print(f"llama.cpp: libllama of {llama_server} ({llama_version(llama_server)})")
        llama_top1 = llama_cpp_top1(llama_server, resolve_source(args.model).path, tokens)
    print("| format | activations | top-1 agreement | mean KL divergence (nats) | top-1 as llama.cpp's |")
    print("| --- | --- | ---: | ---: | ---: |")
    for (name, activations), (agree, kl, top1) in results.items():
        same = "" if llama_top1 is None else f"{(top1 == llama_top1).float().mean().item():.2%}"
        print(f"| {name} | {activations} | {agree:.2%} | {kl:.5f} | {same} |")
    if llama_top1 is not None:
        agree = (reference.argmax(-1) == llama_top1).float().mean().item()
        print(f"| llama.cpp on the same file | its own (CPU, int8 activations) | {agree:.2%} | | 100.00% |")


if __name__ == "__main__":
    main()
