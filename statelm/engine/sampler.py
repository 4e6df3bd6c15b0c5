"""Picks each sequence's next token from its logits with that sequence's own parameters and generator.

One step's pipeline, each stage on the rows that need it and never mixing rows, so a sequence samples
the same token whatever else is in the batch:

    logit bias → min_tokens mask → repetition penalty → presence/frequency penalties → grammar mask
    → forced token → logprobs → greedy argmax, or temperature → min-p → top-k → top-p → draw with the
    sequence's generator

The grammar mask and the forced token come from each sequence's `OutputGuide`; a forced token (a reasoning
budget's end tag) leaves only that token finite in its row, so the row samples it whatever its settings.

Logprobs are taken from the processed logits before temperature and truncation (see `token_logprobs`).
A request whose parameters make a stage fail (or whose distribution cannot be drawn from) fails alone:
its row gets an error and the other rows are sampled as usual.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from statelm.engine.grammar import apply_bitmask, fill_bitmask
from statelm.engine.logits_processors import (
    apply_logit_bias,
    apply_min_p,
    apply_presence_frequency_penalties,
    apply_repetition_penalty,
    token_counts,
    token_logprobs,
)
from statelm.engine.sequence import SamplingParams, Sequence

log = logging.getLogger(__name__)

TOP_P_CANDIDATES = 1024  # top-p looks for its nucleus among this many most likely tokens first


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A generator seeded from the request's seed, or from fresh entropy when it has none."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's logprob and the most likely tokens of its step, (token id, logprob) best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class Sampled:
    """One row's outcome: the token, its logprobs if asked for, or why the row failed."""

    token_id: int = -1
    logprob: TokenLogprob | None = None
    error: str | None = None


Stage = Callable[[torch.Tensor, list[Sequence]], None]


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[Sampled]:
    """Next token for each row of logits [len(seqs), vocab]; rows never influence each other."""
    logits, errors = _processed(logits, seqs)
    chosen = logits.argmax(dim=-1).tolist()
    for row, seq in enumerate(seqs):
        if row in errors or seq.params.greedy:
            continue
        try:
            chosen[row] = _draw(logits[row], seq.params, seq.generator)
        except Exception as exc:  # e.g. every token masked, or NaN logits
            errors[row] = f"sampling failed: {exc}"
    logprobs = _logprobs(logits, seqs, chosen, errors)
    return [
        Sampled(error=errors[row]) if row in errors else Sampled(chosen[row], logprobs.get(row))
        for row in range(len(seqs))
    ]


def _processed(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, dict[int, str]]:
    """Logits after the stages that apply; a failing batch is redone row by row to fail only the culprits."""
    stages = [stage for stage, wanted in _STAGES if any(wanted(seq) for seq in seqs)]
    if not stages:
        return logits, {}
    processed = logits.clone()
    try:
        for stage in stages:
            stage(processed, seqs)
        return processed, {}
    except Exception:
        log.exception("logits processing failed for a batch; retrying row by row")
    errors: dict[int, str] = {}
    processed = logits.clone()
    for row, seq in enumerate(seqs):
        try:
            for stage in stages:
                stage(processed[row : row + 1], [seq])
        except Exception as exc:
            errors[row] = f"logits processing failed: {exc}"
    return processed, errors


def _rows(seqs: list[Sequence], wanted: Callable[[Sequence], bool]) -> list[int]:
    return [row for row, seq in enumerate(seqs) if wanted(seq)]


def _apply_to_rows(logits: torch.Tensor, rows: list[int], transform: Callable[[torch.Tensor], None]) -> None:
    """Run an in-place transform on the selected rows only."""
    if not rows:
        return
    index = torch.tensor(rows, device=logits.device)
    selected = logits.index_select(0, index)
    transform(selected)
    logits.index_copy_(0, index, selected)


def _logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    apply_logit_bias(logits, [seq.params.logit_bias for seq in seqs])


def _min_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Mask EOS and the stop tokens of sequences that have not yet generated min_tokens tokens."""
    rows: list[int] = []
    cols: list[int] = []
    for row, seq in enumerate(seqs):
        if not seq.may_stop():
            ending = [token for token in seq.ending_token_ids() if 0 <= token < logits.shape[1]]
            rows += [row] * len(ending)
            cols += ending
    if rows:
        logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")


def _repetition_penalty(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    rows = _rows(seqs, _wants_repetition_penalty)
    chosen = [seqs[row] for row in rows]

    def transform(selected: torch.Tensor) -> None:
        windows = [_penalty_window(seq) for seq in chosen]
        counts = token_counts(windows, selected.shape[1], selected.device)
        penalty = torch.tensor([seq.params.repetition_penalty for seq in chosen], device=selected.device)
        apply_repetition_penalty(selected, counts, penalty)

    _apply_to_rows(logits, rows, transform)


def _penalty_window(seq: Sequence) -> list[int]:
    """The context the repetition penalty looks at: all tokens, or the last repetition_penalty_range of them."""
    window = seq.params.repetition_penalty_range
    return seq.tokens if window < 0 else seq.tokens[len(seq.tokens) - window :]


def _presence_frequency(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    rows = _rows(seqs, _wants_presence_frequency)
    chosen = [seqs[row] for row in rows]

    def transform(selected: torch.Tensor) -> None:
        counts = token_counts([seq.output_ids for seq in chosen], selected.shape[1], selected.device)
        device = selected.device
        presence = torch.tensor([seq.params.presence_penalty for seq in chosen], device=device)
        frequency = torch.tensor([seq.params.frequency_penalty for seq in chosen], device=device)
        apply_presence_frequency_penalties(selected, counts, presence, frequency)

    _apply_to_rows(logits, rows, transform)


def _wants_repetition_penalty(seq: Sequence) -> bool:
    return seq.params.repetition_penalty != 1.0 and seq.params.repetition_penalty_range != 0


def _wants_presence_frequency(seq: Sequence) -> bool:
    return seq.params.presence_penalty != 0.0 or seq.params.frequency_penalty != 0.0


def _guide_masks(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Each guided row's grammar mask, or its forced token: the only token left finite in the row."""
    guides = [(row, seq.guide) for row, seq in enumerate(seqs) if seq.guide is not None]
    forced = [(row, guide.forced_token) for row, guide in guides if guide.forced_token is not None]
    matchers = [
        (row, guide.matcher)
        for row, guide in guides
        if guide.forced_token is None and guide.matcher is not None and guide.matcher.active
    ]
    if matchers:
        bitmask = fill_bitmask([matcher for _, matcher in matchers], logits.shape[1])
        _apply_to_rows(logits, [row for row, _ in matchers], lambda selected: apply_bitmask(selected, bitmask))
    if forced:
        rows = torch.tensor([row for row, _ in forced], device=logits.device)
        tokens = torch.tensor([token for _, token in forced], device=logits.device)
        logits.index_fill_(0, rows, float("-inf"))
        logits[rows, tokens] = 0.0


def _wants_guide_masks(seq: Sequence) -> bool:
    return seq.guide is not None and seq.guide.constrains


# In order; each stage runs only when some row of the batch wants it.
_STAGES: list[tuple[Stage, Callable[[Sequence], bool]]] = [
    (_logit_bias, lambda seq: bool(seq.params.logit_bias)),
    (_min_tokens, lambda seq: not seq.may_stop()),
    (_repetition_penalty, _wants_repetition_penalty),
    (_presence_frequency, _wants_presence_frequency),
    (_guide_masks, _wants_guide_masks),
]


def _logprobs(
    logits: torch.Tensor, seqs: list[Sequence], chosen: list[int], errors: dict[int, str]
) -> dict[int, TokenLogprob]:
    """Logprobs of the chosen tokens for the rows that asked for them."""
    rows = [row for row, seq in enumerate(seqs) if seq.params.logprobs is not None and row not in errors]
    if not rows:
        return {}
    num_top = max(seqs[row].params.logprobs or 0 for row in rows)
    index = torch.tensor(rows, device=logits.device)
    result = token_logprobs(logits.index_select(0, index), torch.tensor([chosen[row] for row in rows]), num_top)
    chosen_logprobs = result.chosen.tolist()
    top_ids, top_logprobs = result.top_ids.tolist(), result.top_logprobs.tolist()
    records = {}
    for position, row in enumerate(rows):
        keep = seqs[row].params.logprobs or 0
        top = tuple(zip(top_ids[position][:keep], top_logprobs[position][:keep], strict=True))
        records[row] = TokenLogprob(chosen[row], chosen_logprobs[position], top)
    return records


def _draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from logits / temperature, restricted by min-p, to the top-k tokens and to the top-p nucleus.

    Truncation works on the few most likely tokens (`topk`) rather than a sort of the vocabulary, and the
    draw inverts the candidates' cumulative distribution with one uniform number from the generator.
    """
    scaled = (logits / params.temperature).unsqueeze(0)
    if params.min_p > 0.0:
        apply_min_p(scaled, torch.tensor([params.min_p], device=scaled.device))
    scaled = scaled.squeeze(0)
    if params.top_k > 0:
        values, candidates = torch.topk(scaled, min(params.top_k, scaled.numel()))
        probs = torch.softmax(values, dim=-1)
    else:
        full = torch.softmax(scaled, dim=-1)
        probs, candidates = full, None
        if params.top_p < 1.0:
            probs, candidates = torch.topk(full, min(TOP_P_CANDIDATES, full.numel()))
            if float(probs.sum()) < params.top_p:  # a nucleus wider than the candidates: take them all, in order
                probs, candidates = torch.sort(full, descending=True)
    if params.top_p < 1.0:
        outside = torch.cumsum(probs, dim=-1) - probs >= params.top_p
        outside[0] = False  # the most likely token is always in the nucleus
        probs = probs.masked_fill(outside, 0.0)
    cumulative = torch.cumsum(probs, dim=-1)
    total = float(cumulative[-1])
    if not 0.0 < total < math.inf:
        raise ValueError(f"no token can be drawn (total probability {total})")
    threshold = torch.rand(1, generator=generator, device=probs.device) * total
    position = int(torch.searchsorted(cumulative, threshold, right=True).clamp_(max=probs.numel() - 1))
    return position if candidates is None else int(candidates[position])
