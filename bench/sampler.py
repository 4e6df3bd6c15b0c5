"""The sampler alone: time of one `sample()` call for a batch of rows over a vocabulary (SmolLM2's 49,152 tokens).

Usage: .venv/bin/python -m bench.sampler [--threads N] [--repeats 50] [--vocab 128256]
Rows are unseeded decode rows as the engine builds them; the logits fall off with rank like a model's (Zipf,
exponent 1.2, random order per row), so a 0.9 nucleus at temperature 0.7 holds about fifteen tokens. Medians of
--repeats calls after warm-up; on a shared machine the figures are noisy.
"""

from __future__ import annotations

import argparse

import torch

from bench.common import machine_report, median_ms
from statelm.engine.sampler import make_generator, sample
from statelm.engine.sequence import SamplingParams, Sequence

DEFAULT_VOCAB = 49_152  # SmolLM2's; Llama 3's is 128,256
SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "t=0.7 top_p=0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "t=0.7 top_k=40": SamplingParams(temperature=0.7, top_k=40),
    "t=1.0 (whole vocab)": SamplingParams(temperature=1.0),
}


def model_like_logits(rows: int, vocab: int = DEFAULT_VOCAB, seed: int = 0) -> torch.Tensor:
    """[rows, vocab] logits whose probabilities fall off as rank^-1.2, each row in its own random token order."""
    generator = torch.Generator().manual_seed(seed)
    ranked = -1.2 * torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))
    order = torch.argsort(torch.rand(rows, vocab, generator=generator), dim=-1)
    return ranked[order] + 0.1 * torch.randn(rows, vocab, generator=generator)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--vocab", type=int, default=DEFAULT_VOCAB, help="logits a row")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_report())
    print(f"vocab {args.vocab}; {args.threads} threads; median of {args.repeats} calls, ms")
    batches = (1, 16, 64)
    print(f"{'settings':<22}" + "".join(f"{f'{rows} rows':>11}" for rows in batches))
    generator = make_generator(None, torch.device("cpu"))
    for name, params in SETTINGS.items():
        cells = []
        for rows in batches:
            logits = model_like_logits(rows, args.vocab)
            seqs = [Sequence(f"r{row}", [1], params, frozenset({0}), 10**6) for row in range(rows)]
            cells.append(median_ms(lambda logits=logits, seqs=seqs: sample(logits, seqs, generator), args.repeats))
        print(f"{name:<22}" + "".join(f"{ms:>11.3f}" for ms in cells))


if __name__ == "__main__":
    main()
