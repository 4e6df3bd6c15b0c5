"""statelm and llama-server on the same GGUF of a real model's shape: random weights, quantized by llama.cpp itself.

Usage: .venv/bin/python -m bench.realsize [--shapes llama-3.2-1b,llama-3.2-3b,qwen2.5-0.5b,gemma-3-1b,...]
           [--types Q4_K_M,Q8_0]
           [--dir DIR] [--make-only] [bench.peers flags: --rounds 2 --concurrency 1,8 --output-tokens 64 ...]
For each shape it writes (once) an F16 GGUF of that architecture's sizes with random weights (normal, std 0.02;
norms 1; tied embeddings) and SmolLM2's vocabulary and chat template, taken from the bundled GGUF (a `-128k` shape
pads the vocabulary with made-up words to the model's own 128,256 tokens, so that its embedding, LM head and
logits are the real ones' size), and quantizes it with llama.cpp's `llama-quantize` (built with
llama-server, see bench.peers) to each type. Then, per file, each server's first start (statelm with an empty model
cache), and rounds of start / measure / stop, one server at a time, alternating (bench.peers): decode rates, time to
first token, start-up, RSS after the workloads and at peak.
Both servers get the same context: llama-server `-c slots * slot_ctx -np slots`, statelm a float16 KV cache of as
many tokens.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFWriter

from bench.common import ROOT, machine_report
from bench.peers import (
    LLAMA,
    SLOT_MARGIN_TOKENS,
    Metric,
    Server,
    add_comparison_arguments,
    alternate_rounds,
    find_llama_server,
    llama_version,
    make_servers,
    print_comparison,
    settings_line,
    stop,
    write_json,
)
from statelm.models.gguf_file import GGUFFile
from statelm.models.loader import resolve_source
from statelm.models.model_cache import CACHE_DIR_ENV


@dataclass(frozen=True)
class Shape:
    """A model's architecture and sizes, as its Hugging Face config gives them."""

    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    rope_theta: float
    rms_eps: float
    qkv_bias: bool = False
    head_size: int = 0  # 0: hidden // heads
    qk_norm: bool = False
    tied_embeddings: bool = True
    experts: int = 0  # a mixture of experts: experts per layer, of which experts_used run per token
    experts_used: int = 0
    expert_ffn: int = 0
    sandwich_norms: bool = False  # Gemma: norms after attention and after the MLP too
    sliding_window: int = 0  # Gemma: of its sliding layers (llama.cpp knows which layers they are)
    attn_softcap: float = 0.0  # Gemma 2: soft-capped attention scores and logits
    final_softcap: float = 0.0
    vocab: int = 0  # 0: the bundled tokenizer's 49,152 tokens; more: those, then made-up words (padded_vocabulary)

    @property
    def head_dim(self) -> int:
        """Per-head size."""
        return self.head_size or self.hidden // self.heads


SHAPES = {
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, 500000.0, 1e-5),
    "llama-3.2-1b-128k": Shape("llama", 2048, 16, 32, 8, 8192, 500000.0, 1e-5, vocab=128256),
    "llama-3.2-3b": Shape("llama", 3072, 28, 24, 8, 8192, 500000.0, 1e-5),
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 14336, 500000.0, 1e-5),
    "qwen2.5-0.5b": Shape("qwen2", 896, 24, 14, 2, 4864, 1000000.0, 1e-6, qkv_bias=True),
    "gemma-2-2b": Shape(
        "gemma2",
        2304,
        26,
        8,
        4,
        9216,
        10000.0,
        1e-6,
        head_size=256,
        sandwich_norms=True,
        sliding_window=4096,
        attn_softcap=50.0,
        final_softcap=30.0,
    ),
    "gemma-3-1b": Shape(
        "gemma3",
        1152,
        26,
        4,
        1,
        6912,
        1000000.0,
        1e-6,
        head_size=256,
        qk_norm=True,
        sandwich_norms=True,
        sliding_window=512,
    ),
    # Qwen3-30B-A3B's layers (128 experts of 768, 8 a token; 32/4 heads of 128), 4 of its 48: a small MoE
    "qwen3-30b-a3b-4l": Shape(
        "qwen3moe",
        2048,
        4,
        32,
        4,
        6144,
        1000000.0,
        1e-6,
        head_size=128,
        qk_norm=True,
        tied_embeddings=False,
        experts=128,
        experts_used=8,
        expert_ffn=768,
    ),
}
ROUTER = "ffn_gate_inp.weight"  # float32, as llama.cpp's converter keeps a router
TOKENIZER_KEYS = {  # SmolLM2's tokenizer fields and how GGUFWriter writes them
    "tokenizer.ggml.model": "add_tokenizer_model",
    "tokenizer.ggml.pre": "add_tokenizer_pre",
    "tokenizer.ggml.tokens": "add_token_list",
    "tokenizer.ggml.token_type": "add_token_types",
    "tokenizer.ggml.merges": "add_token_merges",
    "tokenizer.ggml.bos_token_id": "add_bos_token_id",
    "tokenizer.ggml.eos_token_id": "add_eos_token_id",
    "tokenizer.ggml.unknown_token_id": "add_unk_token_id",
    "tokenizer.ggml.padding_token_id": "add_pad_token_id",
    "tokenizer.ggml.add_bos_token": "add_add_bos_token",
    "tokenizer.chat_template": "add_chat_template",
}


def tensor_shapes(shape: Shape, vocab: int) -> dict[str, tuple[int, ...]]:
    """GGUF tensor names and [rows, columns] (or [size]) of a model of the shape, in file order."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    tensors: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, shape.hidden)}
    for i in range(shape.layers):
        block: dict[str, tuple[int, ...]] = {
            "attn_norm.weight": (shape.hidden,),
            "attn_q.weight": (q, shape.hidden),
            "attn_k.weight": (kv, shape.hidden),
            "attn_v.weight": (kv, shape.hidden),
            "attn_output.weight": (shape.hidden, q),
            "ffn_norm.weight": (shape.hidden,),
        }
        if shape.qk_norm:
            block.update({"attn_q_norm.weight": (shape.head_dim,), "attn_k_norm.weight": (shape.head_dim,)})
        if shape.sandwich_norms:
            block.update({"post_attention_norm.weight": (shape.hidden,), "post_ffw_norm.weight": (shape.hidden,)})
        if shape.experts:
            block.update({
                "ffn_gate_inp.weight": (shape.experts, shape.hidden),
                "ffn_gate_exps.weight": (shape.experts, shape.expert_ffn, shape.hidden),
                "ffn_up_exps.weight": (shape.experts, shape.expert_ffn, shape.hidden),
                "ffn_down_exps.weight": (shape.experts, shape.hidden, shape.expert_ffn),
            })  # fmt: skip
        else:
            block.update({
                "ffn_gate.weight": (shape.ffn, shape.hidden),
                "ffn_up.weight": (shape.ffn, shape.hidden),
                "ffn_down.weight": (shape.hidden, shape.ffn),
            })  # fmt: skip
        if shape.qkv_bias:
            block.update({"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)})
        tensors.update({f"blk.{i}.{name}": size for name, size in block.items()})
    tensors["output_norm.weight"] = (shape.hidden,)
    if not shape.tied_embeddings:
        tensors["output.weight"] = (vocab, shape.hidden)
    return tensors


def write_f16(path: Path, name: str, shape: Shape, seed: int = 0) -> None:
    """An F16 GGUF of the shape with random weights, written tensor by tensor."""
    tokenizer = padded_vocabulary(GGUFFile(resolve_source("default").path).header.fields, shape.vocab)
    vocab = len(tokenizer["tokenizer.ggml.tokens"])
    writer = GGUFWriter(path, arch=shape.arch)
    writer.add_name(f"random {name}")
    writer.add_context_length(8192)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_block_count(shape.layers)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    if shape.head_size:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
    if shape.attn_softcap:
        writer.add_attn_logit_softcapping(shape.attn_softcap)
        writer.add_final_logit_softcapping(shape.final_softcap)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.expert_ffn)
    writer.add_vocab_size(vocab)
    writer.add_file_type(1)  # mostly F16
    for key, method in TOKENIZER_KEYS.items():
        if key in tokenizer:
            getattr(writer, method)(tokenizer[key])
    tensors = tensor_shapes(shape, vocab)
    for tensor, size in tensors.items():
        dtype = np.float16 if len(size) > 1 and not tensor.endswith(ROUTER) else np.float32
        writer.add_tensor_info(tensor, size, np.dtype(dtype), int(np.prod(size)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for tensor, size in tensors.items():
        if len(size) == 1:
            values = np.ones(size) if tensor.endswith("norm.weight") else np.zeros(size)  # norms, biases
            writer.write_tensor_data(values.astype(np.float32))
        else:
            values = rng.standard_normal(size, dtype=np.float32) * 0.02
            writer.write_tensor_data(values if tensor.endswith(ROUTER) else values.astype(np.float16))
    writer.close()


def padded_vocabulary(fields: Mapping[str, Any], size: int) -> Mapping[str, Any]:
    """The tokenizer fields padded up to `size` with made-up words (a space and four letters, byte-level): normal
    tokens that render text as a real vocabulary's do, so that a stream has a chunk for every token it samples
    (the merges never produce them: a reply's text tokenizes back into the file's own tokens)."""
    tokens = list(fields["tokenizer.ggml.tokens"])
    if size <= len(tokens):
        return fields
    types = list(fields.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    taken = set(tokens)
    words = ("\u0120" + "".join(letters) for letters in itertools.product(string.ascii_lowercase, repeat=4))
    extra = list(itertools.islice((word for word in words if word not in taken), size - len(tokens)))
    return {**fields, "tokenizer.ggml.tokens": tokens + extra, "tokenizer.ggml.token_type": types + [1] * len(extra)}


def model_file(directory: Path, name: str, qtype: str, llama_quantize: Path) -> Path:
    """The quantized GGUF of a shape, made (F16 source, then llama-quantize) when missing."""
    target = directory / f"{name}-{qtype}.gguf"
    if target.is_file():
        return target
    source = directory / f"{name}-F16.gguf"
    if not source.is_file():
        print(f"writing {source}", flush=True)
        write_f16(source.with_suffix(".tmp"), name, SHAPES[name])
        source.with_suffix(".tmp").rename(source)
    print(f"quantizing {source.name} to {qtype} with {llama_quantize}", flush=True)
    partial = target.with_suffix(".tmp")
    threads = str(len(os.sched_getaffinity(0)))
    subprocess.run([str(llama_quantize), str(source), str(partial), qtype, threads], check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    partial.rename(target)
    return target


def kv_bytes_per_token(path: Path) -> int:
    """A float16 KV cache's bytes per token of the file's model."""
    fields = GGUFFile(path).header.fields
    arch = fields["general.architecture"]
    heads, kv_heads = fields[f"{arch}.attention.head_count"], fields[f"{arch}.attention.head_count_kv"]
    head_dim = fields.get(f"{arch}.attention.key_length") or fields[f"{arch}.embedding_length"] // heads
    return fields[f"{arch}.block_count"] * kv_heads * head_dim * 2 * 2


def first_starts(servers: list[Server]) -> dict[str, float]:
    """Each server's first start on the file: statelm's with an empty model cache (a new file for it)."""
    starts = {}
    for server in servers:
        with tempfile.TemporaryDirectory() as cache:
            saved = os.environ.get(CACHE_DIR_ENV)
            os.environ[CACHE_DIR_ENV] = cache  # inherited by the server process
            try:
                process, seconds = server.start()
                stop(process)
            finally:
                if saved is None:
                    os.environ.pop(CACHE_DIR_ENV)
                else:
                    os.environ[CACHE_DIR_ENV] = saved
        starts[server.label] = seconds
        print(f"{server.label}: first start {seconds:.2f} s", flush=True)
    return starts


def compare_on(path: Path, args: argparse.Namespace, llama: Path | None, levels: list[int]) -> dict[str, Any]:
    """Both servers on one file: first starts, then the alternating rounds and the table."""
    slots = max(levels)
    tokens = slots * (max(args.prompt_tokens, args.ttft_prompt_tokens) + args.output_tokens + SLOT_MARGIN_TOKENS)
    kv = f"--kv-cache-memory {tokens * kv_bytes_per_token(path)} --kv-cache-dtype float16 --max-num-seqs {slots}"
    run_args = argparse.Namespace(**{**vars(args), "statelm_args": f"{kv} {args.statelm_args}".strip()})
    servers = make_servers(run_args, llama, path, levels, model=str(path))
    header = "\n".join(
        [
            f"gguf: {path} ({path.stat().st_size / 2**20:.0f} MiB)",
            *(f"{server.label}: {server.shown}" for server in servers),
            settings_line(args, levels),
            f"context: {tokens} tokens for both ({slots} slots); start-up in the rounds is a warm one",
        ]
    )
    print(f"\n{header}", flush=True)
    starts = first_starts(servers)
    runs = alternate_rounds(servers, run_args, levels)
    for label, seconds in starts.items():
        runs[label][0]["first_start_s"] = seconds
    print(f"\n{header}")
    first = Metric("first start on a new file (s; statelm: empty model cache)", False, lambda r: r.get("first_start_s"))
    rows = print_comparison(runs, run_args, levels, (first,))
    return {"file": str(path), "header": header, "table": rows, "runs": runs}


def main() -> None:
    """Make the files, then compare the servers on each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="llama-3.2-1b", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--types", default="Q4_K_M,Q8_0", help="llama-quantize types, comma-separated")
    parser.add_argument("--dir", type=Path, default=ROOT / "tmp" / "realsize", help="where the GGUFs are kept")
    parser.add_argument("--make-only", action="store_true", help="write and quantize the files, measure nothing")
    add_comparison_arguments(parser, concurrency="1,8", output_tokens=64, ttft_prompt_tokens=500)
    args = parser.parse_args()
    levels = [int(level) for level in args.concurrency.split(",")]
    llama = find_llama_server(args.llama_server)
    args.dir.mkdir(parents=True, exist_ok=True)
    files = [
        model_file(args.dir, name, qtype, llama.parent / "llama-quantize")
        for name in args.shapes.split(",")
        for qtype in args.types.split(",")
    ]
    if args.make_only:
        return
    print(machine_report())
    print(f"llama-server: {llama} ({llama_version(llama)})")
    print(f"Command: `{shlex.join(['.venv/bin/python', '-m', 'bench.realsize', *sys.argv[1:]])}`", flush=True)
    labels = args.servers.split(",")
    results = [compare_on(path, args, llama if LLAMA in labels else None, levels) for path in files]
    if args.json:
        write_json(args.json, machine_report(), args, {"files": results, "time": time.time()})


if __name__ == "__main__":
    main()
