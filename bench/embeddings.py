"""Embedding throughput: statelm's encoder path against llama.cpp's `llama-server --embedding` on the same GGUF.

Usage: .venv/bin/python -m bench.embeddings [--llama-server PATH] [--type f16|f32] [--batch 64] [--rounds 20]
           [--threads N] [--llama-args ARGS] [--gguf PATH]

A BERT of all-MiniLM-L6-v2's shape (22.7M parameters: 6 layers, hidden 384, 12 heads, vocabulary 30,522) with
random weights is written as a GGUF with gguf's writer in llama.cpp's BERT layout (mean pooling), unless --gguf
names one. Both servers load that file: statelm as `--embedding-model`, llama-server with `--embedding --pooling
mean` and one slot per text of the batch. Each round sends one /v1/embeddings request of --batch short texts
(10-20 tokens each) to each server in turn (the order alternating), one server working at a time; the figure is
texts per second from the median round, and the vectors of the two servers are compared (cosine).
"""

from __future__ import annotations

import argparse
import random
import shlex
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench.common import launch, machine_report, start_server
from bench.peers import find_llama_server, llama_version, stop
from tests.models.tiny_encoders import WORDS, make_tiny_bert_dir, write_bert_gguf

MINILM_SHAPE = {
    "vocab_size": 30522,
    "hidden_size": 384,
    "num_hidden_layers": 6,
    "num_attention_heads": 12,
    "intermediate_size": 1536,
    "max_position_embeddings": 512,
}


def short_texts(count: int, seed: int = 0) -> list[str]:
    """count sentences of 8 to 18 words of the model's vocabulary."""
    rng = random.Random(seed)
    words = [word for word in WORDS if word.isalpha()]
    return [" ".join(rng.choices(words, k=rng.randint(8, 18))) + "." for _ in range(count)]


def make_gguf(folder: Path, float16: bool) -> Path:
    """A random BERT of MiniLM-L6's shape, as a GGUF in folder."""
    model_dir = make_tiny_bert_dir(folder / "minilm-shape", shape=MINILM_SHAPE)
    return write_bert_gguf(model_dir, folder / f"bert-minilm-shape-{'f16' if float16 else 'f32'}.gguf", float16=float16)


def embed(url: str, model: str, texts: list[str]) -> tuple[float, np.ndarray, int]:
    """One request's seconds, vectors and prompt tokens."""
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/embeddings", json={"model": model, "input": texts}, timeout=600)
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    body = response.json()
    vectors = np.array([item["embedding"] for item in sorted(body["data"], key=lambda item: item["index"])])
    return elapsed, vectors, body["usage"]["prompt_tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", type=Path, help="llama-server binary; default: the shared build script's")
    parser.add_argument("--gguf", type=Path, help="a BERT GGUF to use instead of a random one")
    parser.add_argument("--type", choices=("f16", "f32"), default="f16", help="the random GGUF's matrices")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2, help="both servers' threads")
    parser.add_argument("--llama-args", default="", help="extra llama-server flags")
    parser.add_argument("--ports", default="8441,8442")
    args = parser.parse_args()
    llama = find_llama_server(args.llama_server)
    print(machine_report())
    print(f"llama-server: {llama_version(llama)}")
    texts = short_texts(args.batch)
    with tempfile.TemporaryDirectory() as tmp:
        gguf = args.gguf or make_gguf(Path(tmp), args.type == "f16")
        statelm_port, llama_port = (int(port) for port in args.ports.split(","))
        statelm_args = ["--embedding-model", str(gguf), "--threads", str(args.threads)]
        llama_cmd = [str(llama), "-m", str(gguf), "--embedding", "--pooling", "mean", "-t", str(args.threads),
                     "-np", str(args.batch), "-c", str(args.batch * 64), "-b", "8192", "-ub", "8192",
                     "--port", str(llama_port), *shlex.split(args.llama_args)]  # fmt: skip
        print(f"model: {gguf.name}; batch of {args.batch} texts; {args.rounds} rounds")
        print(f"statelm serve --model default {shlex.join(statelm_args)}")
        print(shlex.join(llama_cmd))
        started = start_server(statelm_args, statelm_port)[0]
        try:
            llama_process = launch(llama_cmd, llama_port)[0]
        except SystemExit:
            stop(started)
            raise
        servers = {
            "statelm": (started, f"http://127.0.0.1:{statelm_port}", gguf.stem),
            "llama-server": (llama_process, f"http://127.0.0.1:{llama_port}", gguf.stem),
        }
        try:
            times: dict[str, list[float]] = {name: [] for name in servers}
            vectors: dict[str, np.ndarray] = {}
            tokens = 0
            for name, (_, url, model) in servers.items():  # warm-up
                _, vectors[name], tokens = embed(url, model, texts)
            for round_ in range(args.rounds):
                order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
                for name in order:
                    _, url, model = servers[name]
                    times[name].append(embed(url, model, texts)[0])
        finally:
            for process, _, _ in servers.values():
                stop(process)
    cosine = np.sum(vectors["statelm"] * vectors["llama-server"], axis=1) / (
        np.linalg.norm(vectors["statelm"], axis=1) * np.linalg.norm(vectors["llama-server"], axis=1)
    )
    print(f"{tokens} prompt tokens per batch; statelm vs llama-server vectors: cosine min {cosine.min():.6f}")
    print("| server | median ms / batch | texts/s | tokens/s | min ms | max ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, measured in times.items():
        median = statistics.median(measured)
        print(f"| {name} | {median * 1000:.1f} | {args.batch / median:.0f} | {tokens / median:.0f} | "
              f"{min(measured) * 1000:.1f} | {max(measured) * 1000:.1f} |")  # fmt: skip
    ratio = statistics.median(times["llama-server"]) / statistics.median(times["statelm"])
    print(f"statelm / llama-server throughput: {ratio:.2f}x")


if __name__ == "__main__":
    main()
