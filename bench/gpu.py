"""GPU benchmark of the engine alone (no HTTP): decode, prefill, long context, HBM bandwidth, transformers.

Usage: python -m bench.gpu [--budget-s 540] [--engine-args batch_invariant=false enforce_eager=true] [--json PATH]
On a lent H100 (repository root, `.whl` carried: the image lacks some of statelm's packages), about 6 minutes:
    source bench/gpu_env.sh && PYTHONUNBUFFERED=1 exec python3 -m bench.gpu --budget-s 330 --json $OUT/gpu.json
Smoke run without a GPU: .venv/bin/python -m bench.gpu --device cpu --preset tiny

Dummy (random) weights of a Llama-3-8B config in bfloat16, built as `statelm serve --load-format dummy` builds
them (a temporary model folder: config.json and a 128,256-entry word-level tokenizer; the random values are
drawn on the device, which takes seconds instead of a minute of CPU). One engine serves every measurement:
- decode: `batch` greedy `ignore_eos` requests with short prompts; warm-up steps, then timed steps (median);
- prefill: time to first token of one prompt of --prefill-tokens tokens, in max_num_batched_tokens chunks;
- long context: decode at batch 1 after a prompt of each --contexts length (its prefill time printed too);
- HBM bandwidth: (weights + KV bytes read per step) / step time, against a device-to-device copy in this run;
- transformers: `generate` of LlamaForCausalLM from the same config (random weights, sdpa, static cache).
--budget-s bounds the whole run: a section that would start past it is skipped, a long prefill is cut
short, and the results table (always the last thing printed, also on SIGTERM) says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import cpu_name, memory_gib
from statelm.attention.kv_format import KVFormat, kv_format
from statelm.config import EngineConfig
from statelm.engine.builder import create_engine, load_engine_model, step_token_budget
from statelm.engine.client import RequestOutput
from statelm.engine.engine import Engine
from statelm.engine.sequence import SamplingParams
from statelm.models.loader import LoadedModel

ROOT = Path(__file__).resolve().parent.parent
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": {  # Llama-3.1-8B's config.json
        "config": {
            "hidden_size": 4096,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 14336,
            "vocab_size": 128256,
            "rope_theta": 500000.0,
            "max_position_embeddings": 131072,
        },
        "batches": "1,8,64,256",
        "contexts": "1024,32768,131072",
        "prefill_tokens": 8192,
        "steps": 32,
        "copy_bytes": 2 << 30,
    },
    "tiny": {
        "config": {
            "hidden_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 512,
            "vocab_size": 2048,
            "rope_theta": 500000.0,
            "max_position_embeddings": 131072,
        },
        "batches": "1,8",
        "contexts": "256,1024",
        "prefill_tokens": 512,
        "steps": 5,
        "copy_bytes": 64 << 20,
    },
}
HF_BATCHES = (64, 1, 8)  # the ≥5× target's batch first, in case the budget runs out


class Interrupted(BaseException):
    """SIGTERM (a `timeout` running out): stop measuring and print what there is."""


class BudgetExceeded(Exception):
    """The run's time budget ran out inside a measurement."""


@dataclasses.dataclass
class Budget:
    """Wall-clock deadlines: the whole run's, and the earlier one of the statelm sections (room left for HF)."""

    end: float
    statelm_end: float

    def left(self, statelm: bool = True) -> float:
        return (self.statelm_end if statelm else self.end) - time.perf_counter()


def say(line: str = "") -> None:
    print(line, flush=True)


def hf_config(preset: str) -> dict[str, Any]:
    """The preset's Hugging Face config.json contents."""
    config = PRESETS[preset]["config"]
    vocab = config["vocab_size"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **config,
        "head_dim": config["hidden_size"] // config["num_attention_heads"],
        "rope_scaling": dict(LLAMA3_ROPE),
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": vocab - 2,
        "eos_token_id": vocab - 1,
        "torch_dtype": "bfloat16",
    }


def write_model_dir(path: Path, config: dict[str, Any]) -> None:
    """A folder `--load-format dummy` loads: config.json and a word-level tokenizer of the model's vocabulary size
    (the engine samples over the tokenizer's vocabulary, so it must be the model's whole one)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab_size = config["vocab_size"]
    vocab = {f"t{i}": i for i in range(vocab_size - 2)}
    vocab.update({"<|begin_of_text|>": vocab_size - 2, "<|eot_id|>": vocab_size - 1})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<|begin_of_text|>", "<|eot_id|>")])
    backend.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "add_bos_token": False,
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (path / "config.json").write_text(json.dumps(config, indent=1))


# ---------------------------------------------------------------- settings


def parse_size(text: str) -> int:
    """An integer, or a byte size such as 16GiB, 512M, 2G."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT])(i?B)?\s*", text, re.IGNORECASE)
    if match:
        return int(float(match.group(1)) * 1024 ** ("KMGT".index(match.group(2).upper()) + 1))
    return int(text, 0)


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def coerce(field: dataclasses.Field[Any], text: str) -> Any:
    """text as the type of an EngineConfig field, judged by its default (or its annotation when that is None)."""
    default: Any = field.default
    if default is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
    if isinstance(default, bool):
        return parse_bool(text)
    if isinstance(default, int):
        return parse_size(text)
    if isinstance(default, float):
        return float(text)
    if isinstance(default, str):
        return text
    if isinstance(default, (dict, list)):
        return json.loads(text)
    if text.strip().lower() in ("none", "null"):
        return None
    annotation = str(field.type)
    for name, parse in (("bool", parse_bool), ("int", parse_size), ("float", float)):
        if re.search(rf"\b{name}\b", annotation):
            return parse(text)
    return text


def parse_engine_args(items: list[str]) -> dict[str, Any]:
    """key=value pairs (space- or comma-separated) as EngineConfig fields, typed like the fields' defaults."""
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    pairs = [piece for item in items for piece in re.split(r"[,\s]+(?=[A-Za-z_]\w*=)", item.strip()) if piece]
    overrides: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in fields:
            raise SystemExit(f"--engine-args: {pair!r} is not key=value of an EngineConfig field ({', '.join(fields)})")
        try:
            overrides[key] = coerce(fields[key], value)
        except ValueError as exc:
            raise SystemExit(f"--engine-args {key}: {exc}") from None
    return overrides


def int_list(text: str) -> list[int]:
    return [parse_size(part) for part in text.split(",") if part.strip()]


# ---------------------------------------------------------------- machine


def run_text(command: list[str]) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def commit(given: str | None) -> str:
    """--commit when given (a copied tree's .git can be stale), else `git rev-parse --short HEAD` (+ uncommitted
    changes), else unknown."""
    head = "" if given else run_text(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])
    if not head:
        return given or "unknown (no git here; pass --commit)"
    dirty = run_text(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"])
    return head + (" + uncommitted changes" if dirty else "")


def machine_lines(device: torch.device, commit_arg: str | None) -> list[str]:
    cpu, memory = cpu_name(), memory_gib()
    lines = []
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        driver = run_text(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).splitlines()
        lines.append(
            f"GPU: {props.name}, {props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} SMs, "
            f"driver {driver[0] if driver else 'unknown'}, CUDA {torch.version.cuda}"
        )
    else:
        lines.append(f"GPU: none used (device {device})")
    versions = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    for name in ("triton", "transformers"):
        try:
            versions.append(f"{name} {__import__(name).__version__}")
        except Exception:
            versions.append(f"{name} missing")
    lines.append(", ".join(versions))
    lines.append(f"CPU: {cpu}, {os.cpu_count()} cores, {memory:.0f} GiB; torch threads {torch.get_num_threads()}")
    lines.append(f"statelm commit {commit(commit_arg)}")
    return lines


# ---------------------------------------------------------------- timing helpers


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 10) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written; median of reps."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1000)
        else:
            started = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - started)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.1f} MiB"


def rate(bytes_per_s: float) -> str:
    for unit, scale in (("TB/s", 1e12), ("GB/s", 1e9)):
        if bytes_per_s >= scale / 10:
            return f"{bytes_per_s / scale:.2f} {unit}"
    return f"{bytes_per_s / 1e6:.1f} MB/s"


# ---------------------------------------------------------------- statelm


class Bench:
    """The engine under test and helpers that drive it step by step."""

    def __init__(self, engine: Engine, loaded: LoadedModel, device: torch.device, budget: Budget) -> None:
        self.engine = engine
        self.loaded = loaded
        self.device = device
        self.budget = budget
        self.vocab = loaded.config.vocab_size
        self.rng = random.Random(0)
        self.ids = 0
        config = loaded.config
        self.kv_bytes_per_token = engine.runner.kv_cache.bytes_per_token
        model = loaded.model
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if not config.tie_word_embeddings:  # the embedding's rows are gathered, not read whole
            self.weight_bytes -= sum(p.numel() * p.element_size() for p in model.embed_tokens.parameters())
        self.replays = 0  # decode steps that replayed a CUDA graph (counted when the runner has graphs)
        self.graphs = getattr(engine.runner, "graphs", None) is not None
        if self.graphs:
            graphs = engine.runner.graphs
            replay = graphs.replay

            def counted(*args: Any, **kwargs: Any) -> Any:
                self.replays += 1
                return replay(*args, **kwargs)

            graphs.replay = counted

    def prompt(self, length: int) -> list[int]:
        """Random ids below the two special tokens: every prompt differs, so the prefix cache serves none."""
        return [self.rng.randrange(10, self.vocab - 2) for _ in range(length)]

    def request_id(self, kind: str) -> str:
        self.ids += 1
        return f"{kind}-{self.ids}"

    def step(self) -> list[RequestOutput]:
        """One engine step; a failed step (the engine catches its exceptions, OOM too) raises here."""
        outputs = self.engine.step()
        errors = [out.error for out in outputs if out.error]
        if errors:
            raise RuntimeError(f"engine step failed: {errors[0]}")
        return outputs

    def prefill_running(self, what: str) -> int:
        """Step until every added sequence has its prompt computed, with a progress line every 15 s; returns the
        steps taken. Past the budget it raises, saying how far it got."""
        scheduler = self.engine.scheduler
        steps = 0
        started = last_report = time.perf_counter()
        total = sum(len(seq.prompt_ids) for seq in (*scheduler.waiting, *scheduler.running))
        while scheduler.waiting or any(seq.num_uncomputed_tokens > 1 for seq in scheduler.running):
            done = sum(min(seq.num_computed_tokens, len(seq.prompt_ids)) for seq in scheduler.running)
            if self.budget.left() <= 0:
                elapsed = time.perf_counter() - started
                raise BudgetExceeded(f"time budget ran out during {what}: {done} of {total} tokens in {elapsed:.0f} s")
            if time.perf_counter() - last_report > 15:
                last_report = time.perf_counter()
                say(f"  ... {what}: {done} of {total} tokens after {last_report - started:.0f} s")
            self.step()
            steps += 1
        return steps

    def timed_steps(self, count: int, batch: int, what: str) -> tuple[list[float], str]:
        """Seconds of each of `count` decode steps of `batch` sequences (fewer if the budget runs out), and how
        many of them replayed a CUDA graph."""
        times: list[float] = []
        replays = self.replays
        for _ in range(count):
            if self.budget.left() <= 0 and times:
                break
            sync(self.device)
            started = time.perf_counter()
            outputs = self.step()
            sync(self.device)
            times.append(time.perf_counter() - started)
            if len(outputs) != batch:
                raise RuntimeError(f"{what}: a step decoded {len(outputs)} sequences, not {batch}")
        graphs = (
            f"{self.replays - replays}/{len(times)} steps replayed a CUDA graph" if self.graphs else "no CUDA graphs"
        )
        return times, graphs

    def release(self, ids: list[str]) -> None:
        for request_id in ids:
            self.engine.abort(request_id)

    def decode(self, batch: int, prompt_len: int, warmup: int, steps: int) -> dict[str, Any]:
        """Steady-state decode of `batch` sequences with short prompts."""
        step_tokens = self.engine.scheduler.max_num_batched_tokens
        tokens = prefill_steps(batch, prompt_len, step_tokens) + warmup + steps + 4
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        ids = [self.request_id(f"decode{batch}") for _ in range(batch)]
        try:
            for request_id in ids:
                self.engine.add_request(request_id, self.prompt(prompt_len), params)
            started = time.perf_counter()
            self.prefill_running(f"decode batch {batch} prefill")
            prefill_s = time.perf_counter() - started
            running = len(self.engine.scheduler.running)
            if running != batch:
                raise RuntimeError(f"only {running} of {batch} sequences run at once (max_num_seqs, KV pool)")
            for _ in range(warmup):
                self.step()
            times, graphs = self.timed_steps(steps, batch, f"decode batch {batch}")
        finally:
            self.release(ids)
        median = statistics.median(times)
        context = prompt_len + warmup + 1 + len(times) / 2
        return {
            "batch": batch,
            "steps": len(times),
            "ms_per_step": median * 1000,
            "mean_ms_per_step": statistics.fmean(times) * 1000,
            "tok_s": batch / median,
            "context": context,
            "prefill_s": prefill_s,
            "bandwidth": (self.weight_bytes + batch * context * self.kv_bytes_per_token) / median,
            "graphs": graphs,
        }

    def prefill(self, tokens: int, runs: int) -> dict[str, Any]:
        """Time to first token of one `tokens`-long prompt (a warm-up run first); median of runs."""
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        times: list[float] = []
        steps = 0
        for run in range(runs + 1):
            if run > 1 and self.budget.left() <= 0:
                break
            request_id = self.request_id("prefill")
            try:
                self.engine.add_request(request_id, self.prompt(tokens), params)
                sync(self.device)
                started = time.perf_counter()
                steps = 0
                produced = False
                while not produced:
                    if self.budget.left() <= 0:
                        raise BudgetExceeded(f"time budget ran out during the prefill of {tokens} tokens")
                    produced = any(out.request_id == request_id and out.new_token_ids for out in self.step())
                    steps += 1
                sync(self.device)
                elapsed = time.perf_counter() - started
            finally:
                self.release([request_id])
            if run:
                times.append(elapsed)
            say(f"  prefill {tokens} tokens, {'run ' + str(run) if run else 'warm-up'}: {elapsed * 1000:.0f} ms")
        median = statistics.median(times)
        return {"tokens": tokens, "runs": len(times), "ttft_s": median, "tok_s": tokens / median, "steps": steps}

    def context(self, context: int, warmup: int, steps: int) -> dict[str, Any]:
        """Prefill one prompt so that the timed decode steps (batch 1) end at `context` tokens."""
        context = min(context, self.engine.max_model_len)
        prompt_len = context - warmup - steps - 2
        if prompt_len < 1:
            raise RuntimeError(f"context {context} is shorter than the warm-up and timed steps")
        params = SamplingParams(temperature=0.0, max_tokens=warmup + steps + 2, ignore_eos=True)
        request_id = self.request_id(f"context{context}")
        try:
            self.engine.add_request(request_id, self.prompt(prompt_len), params)
            sync(self.device)
            started = time.perf_counter()
            chunks = self.prefill_running(f"the prefill of {prompt_len} tokens")
            sync(self.device)
            prefill_s = time.perf_counter() - started
            say(f"  context {context}: prefill of {prompt_len} tokens in {prefill_s:.2f} s ({chunks} steps)")
            for _ in range(warmup):
                self.step()
            times, graphs = self.timed_steps(steps, 1, f"decode at context {context}")
        finally:
            self.release([request_id])
        median = statistics.median(times)
        mean_context = prompt_len + warmup + 1 + len(times) / 2
        return {
            "context": context,
            "prompt_tokens": prompt_len,
            "prefill_s": prefill_s,
            "prefill_tok_s": prompt_len / prefill_s,
            "steps": len(times),
            "ms_per_step": median * 1000,
            "kv_bytes_read": mean_context * self.kv_bytes_per_token,
            "bandwidth": (self.weight_bytes + mean_context * self.kv_bytes_per_token) / median,
            "graphs": graphs,
        }


def prefill_steps(batch: int, prompt_len: int, step_tokens: int) -> int:
    """A bound on the steps a batch's prompts take, during which its first sequences already decode: each step's
    token budget, less one row per decoding sequence, goes to prompt tokens."""
    return -(-batch * prompt_len // max(1, step_tokens - batch)) + 1


def kv_budget(config: dict[str, Any], kv: KVFormat, block_size: int, needs: list[tuple[int, int]]) -> int:
    """Bytes of KV pool for the largest of needs, each (sequences, tokens per sequence), plus 64 blocks."""
    per_token = kv.bytes_per_token(config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"])
    blocks = max(count * -(-(tokens + 1) // block_size) for count, tokens in needs) + 64
    return blocks * block_size * per_token


# ---------------------------------------------------------------- transformers


def hf_decode(
    config_dict: dict[str, Any],
    device: torch.device,
    batches: list[int],
    prompt_len: int,
    new_tokens: int,
    compile_mode: str,
    budget: Budget,
    results: dict[str, Any],
) -> None:
    """transformers `generate` decode tok/s: (batch × new tokens) / time of a call after a warm-up call."""
    section: dict[str, Any] = {"prompt_tokens": prompt_len, "new_tokens": new_tokens, "batches": {}}
    results["hf"] = section
    try:
        import transformers
        from transformers import LlamaConfig
        from transformers import LlamaForCausalLM as HFLlama
    except Exception as exc:
        section["error"] = f"transformers unavailable: {type(exc).__name__}: {exc}"
        say(f"transformers: {section['error']}")
        return
    section["version"] = transformers.__version__
    started = time.perf_counter()
    config = LlamaConfig.from_dict(dict(config_dict))
    dtype = torch.bfloat16
    with torch.device(device):
        try:
            model = HFLlama._from_config(config, dtype=dtype, attn_implementation="sdpa")
        except TypeError:  # transformers 4.x names it torch_dtype
            model = HFLlama._from_config(config, torch_dtype=dtype, attn_implementation="sdpa")
    model.eval()
    say(
        f"transformers {transformers.__version__}: model built in {time.perf_counter() - started:.1f} s "
        f"({sum(p.numel() for p in model.parameters()) / 1e6:,.1f} M parameters, {model.dtype}, {model.device})"
    )
    try:
        hf_measure(model, config.vocab_size, device, batches, prompt_len, new_tokens, compile_mode, budget, section)
    finally:
        del model
        free_device_memory(device)


def hf_measure(
    model: Any,
    vocab_size: int,
    device: torch.device,
    batches: list[int],
    prompt_len: int,
    new_tokens: int,
    compile_mode: str,
    budget: Budget,
    section: dict[str, Any],
) -> None:
    """Warm-up and timed `generate` calls of each batch size; a batch that fails is reported and skipped."""
    eager = compile_mode == "off" or device.type != "cuda"
    section["compile"] = "eager" if eager else "auto compile (static-cache decode)"
    generator = torch.Generator().manual_seed(1)
    last_cost = 0.0
    for batch in batches:
        left = budget.left(statelm=False)
        if left < max(15.0, 1.2 * last_cost):
            section["batches"][batch] = {"skipped": f"budget: {left:.0f} s left"}
            say(f"transformers batch {batch}: skipped, {left:.0f} s of budget left")
            continue
        ids = torch.randint(10, vocab_size - 2, (batch, prompt_len), generator=generator).to(device)
        batch_started = time.perf_counter()
        section["in_progress"] = f"transformers batch {batch}"
        try:
            entry, eager = hf_batch(model, ids, new_tokens, eager, section)
        except Exception as exc:
            del section["in_progress"]
            section["batches"][batch] = {"error": report_failure(f"transformers batch {batch}", exc)}
            free_device_memory(device)
            continue
        del section["in_progress"]  # left in place on SIGTERM, for the table
        last_cost = time.perf_counter() - batch_started
        section["batches"][batch] = entry
        say(
            f"transformers batch {batch}: {entry['tok_s']:.1f} tok/s ({entry['s']:.2f} s for {new_tokens} tokens; "
            f"warm-up call {entry['warmup_s']:.1f} s)"
        )


def hf_batch(
    model: Any, ids: torch.Tensor, new_tokens: int, eager: bool, section: dict[str, Any]
) -> tuple[dict[str, float], bool]:
    """A warm-up `generate` (compiling, unless eager; eager after a failed compile), then a timed one."""
    batch, prompt_len = ids.shape
    device = ids.device
    kwargs: dict[str, Any] = {
        "attention_mask": torch.ones_like(ids),
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,
        "do_sample": False,
        "cache_implementation": "static",
        "pad_token_id": 0,
    }
    if eager:
        kwargs["disable_compile"] = True
    started = time.perf_counter()
    try:
        model.generate(ids, **kwargs)
    except Exception as exc:
        if eager:
            raise
        eager = True
        section["compile"] = f"eager (compiled generate failed: {short_error(exc)[:200]})"
        say(f"transformers: {section['compile']}; going on without compiling")
        kwargs["disable_compile"] = True
        model.generate(ids, **kwargs)
    warmup_s = time.perf_counter() - started
    sync(device)
    started = time.perf_counter()
    out = model.generate(ids, **kwargs)  # generate runs under no_grad
    sync(device)
    elapsed = time.perf_counter() - started
    if out.shape[1] != prompt_len + new_tokens:
        raise RuntimeError(f"generate returned {out.shape[1] - prompt_len} new tokens, not {new_tokens}")
    return {"tok_s": batch * new_tokens / elapsed, "s": elapsed, "warmup_s": warmup_s}, eager


# ---------------------------------------------------------------- report


def number(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def table(results: dict[str, Any]) -> list[str]:
    """The Markdown results table."""
    rows: list[tuple[str, str, str]] = []
    hf_section = results.get("hf", {})
    hf = hf_section.get("batches", {})
    copy = results.get("copy_bandwidth")
    if "engine_error" in results:
        rows.append(("statelm engine", "FAILED", results["engine_error"]))
    elif "load_s" in results:
        graphs = "CUDA graphs" if results["graphs"] else "no CUDA graphs"
        rows.append(
            (
                "statelm engine",
                f"compute path {results['compute_path']}, {graphs}",
                f"model load {results['load_s']:.1f} s, engine build {results['engine_s']:.1f} s",
            )
        )
    for batch, entry in results.get("decode", {}).items():
        if "error" in entry:
            rows.append((f"decode batch {batch}", "FAILED", entry["error"]))
            continue
        detail = f"median of {entry['steps']} steps, context ≈{entry['context']:.0f}, {entry['graphs']}"
        if isinstance(hf.get(batch), dict) and "tok_s" in hf[batch]:
            detail = f"**{entry['tok_s'] / hf[batch]['tok_s']:.2f}× transformers**; " + detail
        result = f"{number(entry['tok_s'])} tok/s ({entry['ms_per_step']:.2f} ms/step)"
        rows.append((f"decode batch {batch}", result, detail))
    prefill = results.get("prefill")
    if prefill:
        name = f"prefill {results['settings']['prefill_tokens']} tokens (TTFT)"
        if "error" in prefill:
            rows.append((name, "FAILED", prefill["error"]))
        else:
            chunk = results["settings"]["engine"]["max_num_batched_tokens"]
            rows.append(
                (
                    name,
                    f"{number(prefill['tok_s'])} tok/s (TTFT {prefill['ttft_s'] * 1000:.0f} ms)",
                    f"{prefill['steps']} engine steps (max_num_batched_tokens {chunk}), median of {prefill['runs']}",
                )
            )
    for context, entry in results.get("contexts", {}).items():
        if "error" in entry:
            rows.append((f"decode at context {context}, batch 1", "FAILED", entry["error"]))
            continue
        share = f" = {entry['bandwidth'] / copy:.0%} of copy" if copy else ""
        rows.append(
            (
                f"decode at context {context}, batch 1",
                f"{entry['ms_per_step']:.2f} ms/step",
                f"prefill {entry['prefill_s']:.1f} s ({number(entry['prefill_tok_s'])} tok/s); weights + "
                f"{gib(entry['kv_bytes_read'])} KV at {rate(entry['bandwidth'])}{share}; {entry['graphs']}",
            )
        )
    one = results.get("decode", {}).get(1, {})
    if copy:
        if "bandwidth" in one:
            rows.append(
                (
                    "HBM bandwidth, decode batch 1",
                    f"{rate(one['bandwidth'])} = {one['bandwidth'] / copy:.0%} of copy",
                    f"weights {gib(results['weight_bytes'])} + KV of ≈{one['context']:.0f} tokens per "
                    f"{one['ms_per_step']:.2f} ms step",
                )
            )
        timer = "CUDA events" if results["settings"]["engine"]["device"] == "cuda" else "wall clock"
        rows.append(("device-to-device copy", rate(copy), f"bytes read + written, median of 10 ({timer})"))
    if "error" in hf_section:
        rows.append(("transformers generate", "FAILED", hf_section["error"]))
    for batch in sorted(hf):
        entry = hf[batch]
        if "tok_s" in entry:
            detail = (
                f"{hf_section['new_tokens']} new tokens after {hf_section['prompt_tokens']}, "
                f"{hf_section.get('compile', '')}, warm-up call {entry['warmup_s']:.0f} s"
            )
            rows.append((f"transformers batch {batch}", f"{number(entry['tok_s'])} tok/s", detail))
        else:
            state = "FAILED" if "error" in entry else "skipped"
            rows.append((f"transformers batch {batch}", state, entry.get("error") or entry.get("skipped", "")))
    for name in results.get("skipped", []):
        rows.append((name, "skipped", "time budget"))
    for source in (results, hf_section):
        if "in_progress" in source:
            rows.append((source["in_progress"], "INTERRUPTED", "the run was stopped (SIGTERM) during it"))
    lines = ["| measurement | result | detail |", "| --- | --- | --- |"]
    lines += [f"| {a} | {b} | {c.replace('|', '/')} |" for a, b, c in rows]
    return lines


def short_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return text[:300]


def report_failure(what: str, exc: BaseException) -> str:
    message = short_error(exc)
    say(f"{what}: FAILED: {message}")
    tail = traceback.format_exception(exc)[-4:]
    print("".join(tail).rstrip(), file=sys.stderr, flush=True)
    return message


# ---------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto (cuda when present) | cuda | cpu")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    parser.add_argument("--batches", help="decode batch sizes (preset default: 1,8,64,256)")
    parser.add_argument("--contexts", help="contexts of the batch-1 decode (preset default: 1024,32768,131072)")
    parser.add_argument("--prefill-tokens", type=int, help="tokens of the prefill prompt (preset default: 8192)")
    parser.add_argument("--prefill-runs", type=int, default=3, help="timed prefills after a warm-up one")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="prompt of each decode (and HF) sequence")
    parser.add_argument("--steps", type=int, help="timed decode steps (preset default: 32)")
    parser.add_argument("--warmup", type=int, default=5, help="decode steps before the timed ones")
    parser.add_argument("--skip-hf", action="store_true", help="no transformers comparison")
    parser.add_argument("--hf-batches", default=",".join(map(str, HF_BATCHES)))
    parser.add_argument("--hf-new-tokens", type=int, default=128)
    parser.add_argument(
        "--hf-compile",
        choices=("auto", "off"),
        default="auto",
        help="auto: generate as transformers runs it (it compiles the static-cache decode on CUDA); off: eager",
    )
    parser.add_argument("--engine-args", nargs="*", default=[], help="EngineConfig fields as key=value")
    parser.add_argument("--budget-s", type=float, default=540, help="wall-clock budget of the whole run")
    parser.add_argument("--hf-reserve-s", type=float, default=150, help="of the budget, kept for transformers")
    parser.add_argument("--commit", help="commit to print where git is unavailable")
    parser.add_argument("--json", type=Path, help="also write all results here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    budget = Budget(
        end=started + args.budget_s, statelm_end=started + args.budget_s - (0 if args.skip_hf else args.hf_reserve_s)
    )

    def on_sigterm(signum: int, frame: object) -> None:
        raise Interrupted(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_sigterm)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("  [%(name)s] %(message)s"))
    statelm_log = logging.getLogger("statelm")
    statelm_log.addHandler(handler)
    statelm_log.setLevel(logging.INFO)

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    preset = PRESETS[args.preset]
    batches = int_list(args.batches or preset["batches"])
    contexts = sorted(int_list(args.contexts or preset["contexts"]))
    prefill_tokens = args.prefill_tokens or preset["prefill_tokens"]
    steps = args.steps or preset["steps"]
    config_dict = hf_config(args.preset)
    overrides = parse_engine_args(args.engine_args)

    machine = machine_lines(device, args.commit)
    for line in machine:
        say(line)
    results: dict[str, Any] = {"machine": machine, "decode": {}, "contexts": {}, "skipped": []}

    defaults = EngineConfig()
    block_size = overrides.get("block_size", defaults.block_size)
    default_step = max(step_token_budget(defaults, device), max(batches))
    step_tokens = overrides.get("max_num_batched_tokens", default_step)
    prompts_steps = prefill_steps(max(batches), args.prompt_tokens, step_tokens)
    per_seq = args.prompt_tokens + prompts_steps + args.warmup + steps + 8
    needs = [(max(batches), per_seq), (1, prefill_tokens + 2), *((1, c) for c in contexts)]
    engine_settings: dict[str, Any] = {
        "load_format": "dummy",
        "device": device.type,
        "dtype": "bfloat16",
        "quantization": "none",
        "max_num_seqs": max(max(batches), defaults.max_num_seqs),
        "max_num_batched_tokens": default_step,
        "kv_cache_memory": 0,
    }
    engine_settings.update(overrides)
    if "kv_cache_memory" not in overrides:
        kv_dtype = engine_settings.get("kv_cache_dtype", "auto")  # auto: 16-bit (the bfloat16 model's own)
        kv = kv_format("bfloat16" if kv_dtype == "auto" else kv_dtype)
        engine_settings["kv_cache_memory"] = kv_budget(config_dict, kv, block_size, needs)
    results["settings"] = {
        "preset": args.preset,
        "model_config": config_dict,
        "batches": batches,
        "contexts": contexts,
        "prefill_tokens": prefill_tokens,
        "prompt_tokens": args.prompt_tokens,
        "warmup_steps": args.warmup,
        "timed_steps": steps,
        "engine": engine_settings,
        "budget_s": args.budget_s,
    }
    c = config_dict
    say(
        f"model: {args.preset} dummy weights: hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, "
        f"{c['num_attention_heads']} heads / {c['num_key_value_heads']} KV, intermediate {c['intermediate_size']}, "
        f"vocab {c['vocab_size']}, rope theta {c['rope_theta']:g} (llama3 scaling), max positions "
        f"{c['max_position_embeddings']}"
    )
    say(
        f"settings: batches {batches}, contexts {contexts}, prefill {prefill_tokens} tokens "
        f"(warm-up + {args.prefill_runs} runs), decode prompts {args.prompt_tokens} tokens, {args.warmup} warm-up + "
        f"{steps} timed steps (median), greedy, ignore_eos"
    )
    say("engine args (bench defaults, then --engine-args): " + engine_args_text(engine_settings))
    say(
        f"budget: {args.budget_s:.0f} s in all, statelm sections until {budget.statelm_end - started:.0f} s; "
        f"transformers: {'skipped' if args.skip_hf else args.hf_batches}"
    )

    try:
        run_all(args, device, config_dict, engine_settings, batches, contexts, prefill_tokens, steps, budget, results)
    except (Interrupted, KeyboardInterrupt) as exc:
        say(f"interrupted ({exc!r}): reporting what was measured")
        results["interrupted"] = True
    finally:
        results["elapsed_s"] = time.perf_counter() - started
        if args.json:
            try:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(results, indent=1, default=str))
            except OSError as exc:
                say(f"could not write {args.json}: {exc}")
        say()
        say(f"## Results: statelm engine, {args.preset} dummy weights, bfloat16, {results['machine'][0]}")
        say(f"{results['machine'][-1]}; run {results['elapsed_s']:.0f} s; engine {engine_args_text(engine_settings)}")
        ratio = target_ratio(results)
        if ratio:
            say(ratio)
        say()
        for line in table(results):
            say(line)


def summary(entry: dict[str, Any]) -> str:
    """One progress line of a section's result."""
    if "ttft_s" in entry:
        return f"TTFT {entry['ttft_s'] * 1000:.0f} ms, {entry['tok_s']:.0f} tok/s ({entry['steps']} engine steps)"
    line = f"{entry['ms_per_step']:.2f} ms/step"
    if "tok_s" in entry:
        line += f", {entry['tok_s']:.1f} tok/s (mean {entry['mean_ms_per_step']:.2f} ms)"
    return line + f", {rate(entry['bandwidth'])} of weights + KV; {entry['graphs']}"


def engine_args_text(settings: dict[str, Any]) -> str:
    return ", ".join(
        f"{k}={gib(v) if k == 'kv_cache_memory' and isinstance(v, int) else v}"
        for k, v in settings.items()
        if k not in ("load_format", "device")
    )


def target_ratio(results: dict[str, Any]) -> str:
    ours = results.get("decode", {}).get(64, {})
    theirs = results.get("hf", {}).get("batches", {}).get(64, {})
    if "tok_s" in ours and "tok_s" in theirs:
        return f"statelm ÷ transformers at batch 64: {ours['tok_s'] / theirs['tok_s']:.2f}× (target ≥ 5×)"
    return ""


def run_all(
    args: argparse.Namespace,
    device: torch.device,
    config_dict: dict[str, Any],
    engine_settings: dict[str, Any],
    batches: list[int],
    contexts: list[int],
    prefill_tokens: int,
    steps: int,
    budget: Budget,
    results: dict[str, Any],
) -> None:
    copy_bytes = PRESETS[args.preset]["copy_bytes"]
    try:
        results["copy_bandwidth"] = copy_bandwidth(device, copy_bytes)
        say(f"device copy: {rate(results['copy_bandwidth'])} (read + written, {gib(copy_bytes)}, median of 10)")
    except Exception as exc:
        report_failure("device copy", exc)
    free_device_memory(device)

    with tempfile.TemporaryDirectory(prefix="statelm-bench-") as folder:
        write_model_dir(Path(folder), config_dict)
        run_statelm(
            Path(folder), device, engine_settings, batches, contexts, prefill_tokens, steps, args, budget, results
        )
    free_device_memory(device)
    if device.type == "cuda":
        say(f"GPU memory after freeing the engine: {gib(torch.cuda.memory_allocated(device))} allocated")
    if args.skip_hf:
        return
    try:
        hf_batches = int_list(args.hf_batches)
        hf_decode(
            config_dict, device, hf_batches, args.prompt_tokens, args.hf_new_tokens, args.hf_compile, budget, results
        )
    except Exception as exc:
        results.setdefault("hf", {})["error"] = report_failure("transformers", exc)
        free_device_memory(device)


def run_statelm(
    folder: Path,
    device: torch.device,
    engine_settings: dict[str, Any],
    batches: list[int],
    contexts: list[int],
    prefill_tokens: int,
    steps: int,
    args: argparse.Namespace,
    budget: Budget,
    results: dict[str, Any],
) -> None:
    config = EngineConfig(model=str(folder), **engine_settings)
    try:
        started = time.perf_counter()
        loaded = load_engine_model(config)
        sync(device)
        load_s = time.perf_counter() - started
        say(f"model loaded in {load_s:.1f} s")
        started = time.perf_counter()
        engine = create_engine(loaded, config)
        sync(device)
        engine_s = time.perf_counter() - started
        say(
            f"engine created in {engine_s:.1f} s: compute path {loaded.model.compute_path}, "
            f"max model len {engine.max_model_len}, {engine.pool.num_blocks} KV blocks"
        )
        if device.type == "cuda":
            say(
                f"  GPU memory: {gib(torch.cuda.memory_allocated(device))} allocated, "
                f"{gib(torch.cuda.memory_reserved(device))} reserved"
            )
    except Exception as exc:
        results["engine_error"] = report_failure("building the engine", exc)
        for name in ("decode", "prefill", "contexts"):
            results[name] = (
                {"error": f"no engine: {results['engine_error']}"}
                if name == "prefill"
                else {key: {"error": "no engine"} for key in (batches if name == "decode" else contexts)}
            )
        return
    suite = Bench(engine, loaded, device, budget)
    results["load_s"], results["engine_s"] = load_s, engine_s
    results["compute_path"] = loaded.model.compute_path
    results["graphs"] = suite.graphs
    results["weight_bytes"] = suite.weight_bytes
    results["kv_bytes_per_token"] = suite.kv_bytes_per_token
    say(
        f"weights read per decode step {gib(suite.weight_bytes)}; KV {suite.kv_bytes_per_token / 1024:.0f} KiB per "
        f"token of context"
    )

    # (name, where its result goes, its key there, what measures it)
    sections: list[tuple[str, dict[Any, Any], Any, Callable[[], dict[str, Any]]]] = []
    for batch in batches:
        measure = lambda batch=batch: suite.decode(batch, args.prompt_tokens, args.warmup, steps)  # noqa: E731
        sections.append((f"decode batch {batch}", results["decode"], batch, measure))
    measure = lambda: suite.prefill(prefill_tokens, args.prefill_runs)  # noqa: E731
    sections.append((f"prefill {prefill_tokens} tokens", results, "prefill", measure))
    for context in contexts:
        measure = lambda context=context: suite.context(context, args.warmup, steps)  # noqa: E731
        sections.append((f"decode at context {context}", results["contexts"], context, measure))

    for name, target, key, measure in sections:
        if budget.left() <= 0:
            results["skipped"].append(name)
            say(f"{name}: skipped (time budget)")
            continue
        say(f"{name} ... ({budget.left():.0f} s of the statelm budget left)")
        results["in_progress"] = name
        try:
            entry = measure()
        except Exception as exc:
            del results["in_progress"]
            target[key] = {"error": report_failure(name, exc)}
            free_device_memory(device)
            continue
        del results["in_progress"]  # left in place on SIGTERM, for the table
        target[key] = entry
        say(f"{name}: {summary(entry)}")
    one = results["decode"].get(1, {})
    copy = results.get("copy_bandwidth")
    if "bandwidth" in one and copy:
        say(f"HBM bandwidth at batch 1: {rate(one['bandwidth'])} of {rate(copy)} copy ({one['bandwidth'] / copy:.0%})")


if __name__ == "__main__":
    main()
