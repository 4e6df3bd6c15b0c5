"""Picks each sequence's next token from its logits with that sequence's own parameters and generator."""

from __future__ import annotations

import torch

from statelm.engine.sequence import Sequence


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A generator seeded from the request's seed, or from fresh entropy when it has none."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """Next token for each row of logits [len(seqs), vocab]; rows never influence each other."""
    greedy = logits.argmax(dim=-1).tolist()
    tokens: list[int] = []
    for row, seq in enumerate(seqs):
        params = seq.params
        if params.greedy:
            tokens.append(greedy[row])
            continue
        probs = _filtered_probs(logits[row], params.temperature, params.top_k, params.top_p)
        tokens.append(int(torch.multinomial(probs, 1, generator=seq.generator).item()))
    return tokens


def _filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Softmax of logits / temperature restricted to the top-k tokens and the top-p nucleus."""
    scaled = logits / temperature
    if top_k > 0:
        kth = torch.topk(scaled, min(top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs[mass_before >= top_p] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs
