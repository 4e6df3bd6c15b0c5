"""KV capacity per format: resident 4k-token sessions in 1 GiB of KV, the spill and restore of one, its snapshot.

Usage: .venv/bin/python -m bench.kv_capacity [--models default,llama-1b,PATH.gguf] [--kv-cache-dtype float32,auto,q8_0]
    [--session-tokens 4096] [--pool 1GiB] [--runs 5] [--llama-server PATH]

For each model and KV format, in-process on an engine whose KV pool is --pool:
- bytes per token of the pool, against llama.cpp's default (float16 K and V: what llama-server's log reports for a
  GGUF model with --llama-server, else its formula);
- resident sessions: one session of --session-tokens tokens is prefilled, then its KV is loaded into new sessions
  (each into blocks of its own, as the server restores a snapshot) until the pool refuses one: the count held at once;
- spill: what the server does to an idle session under memory pressure, export from the pool and write it as a
  snapshot bundle (fsynced) to a temporary state dir; restore: read it back (checksums) and load it into the pool;
  medians of --runs;
- the snapshot bundle's size on disk.
Models: `default` (SmolLM2-135M Q4_1 GGUF, as served), `llama-1b` (Llama-3.2-1B's shapes, random weights packed
int8 at load: 16 layers, 8 KV heads of 64, float32 activations as the default model's), or any model the server
loads (a GGUF file's path: Llama-3.2-1B's Q8_0, say), as the server loads it.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from bench.common import machine_report, prefilled_session
from bench.gpu import LLAMA3_ROPE, write_model_dir
from statelm.config import EngineConfig, parse_size
from statelm.engine.builder import create_engine, kv_cache_format, load_engine_model
from statelm.engine.engine import Engine
from statelm.engine.session_kv import SessionKVData, SessionKVError
from statelm.models.loader import LoadedModel, resolve_source
from statelm.sessions.directory_store import DirectoryStore
from statelm.sessions.snapshot_format import SnapshotContent, read_snapshot, write_snapshot
from statelm.sessions.state_store import Area

LLAMA_1B = {  # Llama-3.2-1B's config.json
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {**LLAMA3_ROPE, "factor": 32.0},
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "attention_bias": False,
    "bos_token_id": 128254,
    "eos_token_id": 128255,
    "torch_dtype": "bfloat16",
}


def load(model: str, folder: Path) -> LoadedModel:
    """The model as the server loads it; llama-1b as random weights of Llama-3.2-1B's shapes, packed int8."""
    if model != "llama-1b":
        return load_engine_model(EngineConfig(model=model))
    write_model_dir(folder, LLAMA_1B)
    return load_engine_model(EngineConfig(model=str(folder), load_format="dummy", dtype="float32", quantization="int8"))


def fill(engine: Engine, data: SessionKVData) -> int:
    """Sessions held at once: s0, and copies of its KV loaded until the pool refuses one."""
    count = 1
    while True:
        try:
            engine.sessions.load(f"s{count}", data)
        except SessionKVError:
            return count
        count += 1


def spill_and_restore(engine: Engine, loaded: LoadedModel, data: SessionKVData, runs: int) -> tuple[float, float, int]:
    """Median seconds to spill one session (export, write its bundle) and to restore it (read, load); bundle bytes."""
    spills, restores, size = [], [], 0
    with tempfile.TemporaryDirectory() as state:
        store = DirectoryStore(Path(state))
        store.prepare(Area.SESSIONS, True)
        manifest = {"model": {"name": loaded.name, "fingerprint": loaded.fingerprint.parts}}
        for run in range(runs):
            started = time.perf_counter()
            exported = engine.sessions.export("s0")
            assert exported is not None
            engine.sessions.release("s0")
            write_snapshot(store, Area.SESSIONS, f"spill-{run}", manifest, SnapshotContent([], exported))
            spills.append(time.perf_counter() - started)
            started = time.perf_counter()
            _, content = read_snapshot(store, Area.SESSIONS, f"spill-{run}", loaded.fingerprint)
            engine.sessions.load("s0", content.kv)
            restores.append(time.perf_counter() - started)
            size = store.bundle_size(Area.SESSIONS, f"spill-{run}")
    assert len(engine.sessions.pinned["s0"].tokens) == len(data.tokens)
    return statistics.median(spills), statistics.median(restores), size


def llama_cpp_bytes_per_token(server: Path | None, loaded: LoadedModel, model: str) -> tuple[int, str]:
    """llama.cpp's default KV bytes per token (float16 K and V) for the model, and where the figure comes from."""
    config = loaded.config
    formula = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    source = None if model == "llama-1b" else resolve_source(model)
    if server is None or source is None or not source.is_gguf:
        return formula, "formula"
    gguf = source.path
    command = [str(server), "-m", str(gguf), "-c", "4096", "--port", "8731", "-t", "1", "-np", "1", "-v"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(120, process.kill)  # it serves until killed: a log without the line ends here
    timer.start()
    try:
        assert process.stdout is not None
        for line in process.stdout:
            match = re.search(r"size =\s+([0-9.]+) MiB \(\s*(\d+) cells", line)
            if match:
                return round(float(match.group(1)) * 2**20 / int(match.group(2))), "llama-server's log"
    finally:
        timer.cancel()
        process.kill()
        process.wait()
    return formula, "formula"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="default,llama-1b")
    parser.add_argument("--kv-cache-dtype", default="float32,auto,q8_0")
    parser.add_argument("--session-tokens", type=int, default=4096)
    parser.add_argument("--pool", default="1GiB")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--llama-server", type=Path, help="llama-server, for llama.cpp's KV bytes per token")
    args = parser.parse_args()
    print(machine_report())
    pool = parse_size(args.pool)
    print(
        f"settings: {args.session_tokens}-token sessions, a {args.pool} KV pool, spill/restore medians of {args.runs}"
    )
    print("| model | KV cache | bytes/token | vs llama.cpp f16 | resident sessions | vs float32 | spill ms |"
          " restore ms | snapshot MiB |")  # fmt: skip
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for model in args.models.split(","):
        with tempfile.TemporaryDirectory() as folder:
            loaded = load(model, Path(folder))
            create_engine(loaded, EngineConfig(kv_cache_memory=1 << 24))  # the start-up self-check picks the path
            peer, source = llama_cpp_bytes_per_token(args.llama_server, loaded, model)
            float32_count = None
            for kv_dtype in args.kv_cache_dtype.split(","):
                config = EngineConfig(
                    kv_cache_memory=pool,
                    kv_cache_dtype=kv_dtype,
                    enable_prefix_caching=False,
                    max_num_batched_tokens=1024,
                )
                engine = create_engine(loaded, config)
                kv_cache = engine.runner.kv_cache
                data = prefilled_session(engine, args.session_tokens, "s0")
                count = fill(engine, data)
                for index in range(1, count):
                    engine.sessions.release(f"s{index}")
                spill, restore, size = spill_and_restore(engine, loaded, data, args.runs)
                name = kv_cache_format(kv_dtype, loaded).name
                float32_count = count if name == "float32" else float32_count
                relative = f"{count / float32_count:.2f}x" if float32_count else "-"
                per_token = kv_cache.bytes_per_token
                print(f"| {Path(model).name} | {name} | {per_token:,} | {per_token / peer:.2f}x | {count} | "
                      f"{relative} | {spill * 1000:.0f} | {restore * 1000:.0f} | {size / 2**20:.1f} |",
                      flush=True)  # fmt: skip
                del engine, kv_cache
            print(f"(llama.cpp's f16 KV for {Path(model).name}: {peer:,} bytes per token, from its {source})")


if __name__ == "__main__":
    main()
