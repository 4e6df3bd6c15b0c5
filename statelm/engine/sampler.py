"""Picks each sequence's next token from its logits with that sequence's own parameters, the whole batch at once.

One step's pipeline, each stage on the rows that need it and never mixing rows, so a sequence samples
the same token whatever else is in the batch:

    logit bias → min_tokens mask → repetition penalty → presence/frequency penalties → grammar mask
    → forced token → logprobs → greedy argmax, or temperature → min-p → top-k → top-p → draw

The grammar mask and the forced token come from each sequence's `OutputGuide`; a forced token (a reasoning
budget's end tag) leaves only that token finite in its row, so the row samples it whatever its settings.

The draw takes every non-greedy row together, with temperature, min-p, top-k and top-p as per-row tensors.
Rows with top-k or top-p look for their candidates among their few most likely tokens (a top-k selection rather
than a sort of the vocabulary; top-p widens them through TOP_P_CANDIDATES until they hold its nucleus); the others
draw over the whole vocabulary in id order. On the CPU the passes over a whole row (greedy's argmax, the top-k
selection, the draw's running sum) run vectorised: numpy's argmax and the kernels' top_k and inverse_cdf.
Each row inverts its cumulative distribution with one uniform number: a seeded row takes it from its own
generator, so its tokens depend only on its seed, and the unseeded rows take theirs from the engine's generator
in one call. The chosen tokens, greedy rows' included, reach the
host in one transfer (top-p rows add a read of their candidates' mass).

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
    largest,
    sampling_kernels_take,
    token_counts,
    token_logprobs,
)
from statelm.engine.sequence import Sequence

log = logging.getLogger(__name__)

TOP_P_CANDIDATES = (64, 1024)  # top-p seeks its nucleus among this many most likely tokens, then that many, then all


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


def sample(logits: torch.Tensor, seqs: list[Sequence], generator: torch.Generator | None = None) -> list[Sampled]:
    """Next token for each row of logits [len(seqs), vocab]; unseeded rows draw from `generator` (torch's if None)."""
    if not seqs:  # a step of prompt chunks only
        return []
    logits, errors = _processed(logits, seqs)
    drawn = [row for row, seq in enumerate(seqs) if row not in errors and not seq.params.greedy]
    greedy = sorted(set(range(len(seqs))) - set(drawn))  # failed rows too: their token is never used
    parts = []
    if greedy:
        parts.append((greedy, most_likely(_select(logits, greedy))))
    if drawn:
        parts.append((drawn, _draw(_select(logits, drawn), [seqs[row] for row in drawn], generator)))
    tokens = _merge(parts).tolist()
    for row in drawn:
        if tokens[row] < 0:
            errors[row] = "sampling failed: no token can be drawn (no finite probability is left)"
    logprobs = _logprobs(logits, seqs, tokens, errors)
    return [
        Sampled(error=errors[row]) if row in errors else Sampled(tokens[row], logprobs.get(row))
        for row in range(len(seqs))
    ]


def most_likely(logits: torch.Tensor) -> torch.Tensor:
    """Each row's most likely token id, the first where several tie (a NaN counts as the largest), as int64.

    float32 CPU rows go through numpy's argmax, which is vectorised where torch's CPU argmax is a scalar loop:
    5 against 43 us over 49,152 logits, 10 against 108 over Llama 3's 128,256, one thread. Both take the first
    of equal values and the first NaN, so the token is the one torch's argmax picks.
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def _index(rows: list[int], like: torch.Tensor) -> torch.Tensor:
    """Row numbers as an index tensor on like's device."""
    return torch.tensor(rows, dtype=torch.int64, device=like.device)


def _select(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The given rows (ascending) of tensor: the tensor itself, not a copy, when they are all of its rows."""
    return tensor if len(rows) == tensor.shape[0] else tensor.index_select(0, _index(rows, tensor))


def _merge(parts: list[tuple[list[int], torch.Tensor]]) -> torch.Tensor:
    """One tensor from the results of groups of rows that together make the batch; a lone group's as it is."""
    if len(parts) == 1:
        return parts[0][1]
    first = parts[0][1]
    merged = first.new_empty((sum(len(rows) for rows, _ in parts), *first.shape[1:]))
    for rows, values in parts:
        merged.index_copy_(0, _index(rows, merged), values)
    return merged


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


def _draw(logits: torch.Tensor, seqs: list[Sequence], generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from logits / temperature, restricted by min-p, top-k and top-p; -1 where none can be."""
    device = logits.device
    params = [seq.params for seq in seqs]
    uniforms = _uniforms(seqs, generator, device)
    scaled = logits / torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    if any(p.min_p > 0.0 for p in params):
        apply_min_p(scaled, torch.tensor([p.min_p for p in params], device=device))
    vocab = scaled.shape[1]
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else 0 for p in params]
    plain = [row for row, (k, p) in enumerate(zip(top_k, params, strict=True)) if k == 0 and p.top_p >= 1.0]
    ranked = sorted(set(range(len(seqs))) - set(plain))
    parts = []
    if plain:
        probs = torch.softmax(_select(scaled, plain), dim=-1)
        parts.append((plain, _invert(probs, None, vocab, _select(uniforms, plain))))
    if ranked:
        subset_k = [top_k[row] for row in ranked]
        width = min(vocab, max(k or TOP_P_CANDIDATES[0] for k in subset_k))
        top_p = [params[row].top_p for row in ranked]
        parts.append((ranked, _ranked(_select(scaled, ranked), subset_k, top_p, _select(uniforms, ranked), width)))
    return _merge(parts)


def _uniforms(seqs: list[Sequence], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """One uniform number per row: a seeded row's from its own generator, the others' from `generator` in one call."""
    uniforms = torch.rand(len(seqs), generator=generator, device=device)
    seeded = [row for row, seq in enumerate(seqs) if seq.generator is not None]
    if seeded:
        own = [torch.rand(1, generator=seqs[row].generator, device=device) for row in seeded]
        uniforms.index_copy_(0, _index(seeded, uniforms), torch.cat(own))
    return uniforms


def _ranked(
    scaled: torch.Tensor, top_k: list[int], top_p: list[float], uniforms: torch.Tensor, width: int
) -> torch.Tensor:
    """Tokens of rows with top-k or top-p, drawn from their `width` most likely tokens, best first.

    A top-p row without top-k whose nucleus is wider than its candidates (they hold less than top_p) is drawn
    again from the next count of TOP_P_CANDIDATES, then from the whole vocabulary: one host read of the
    candidates' mass per widening.
    """
    probs, ids = _candidates(scaled, top_k, width)
    counts = [k or width for k in top_k]  # at most width
    limit = width if min(counts) == width else torch.tensor(counts, device=scaled.device).unsqueeze(1)
    tokens = _invert(_nucleus(probs, top_p), ids, limit, uniforms)
    vocab = scaled.shape[1]
    if width < vocab and 0 in top_k:
        mass = probs.sum(dim=-1).tolist()
        wide = [row for row, k in enumerate(top_k) if k == 0 and mass[row] < top_p[row]]
        if wide:
            wider = min([count for count in TOP_P_CANDIDATES if count > width] + [vocab])
            again = _ranked(
                _select(scaled, wide), [0] * len(wide), [top_p[row] for row in wide], _select(uniforms, wide), wider
            )
            tokens.index_copy_(0, _index(wide, tokens), again)
    return tokens


def _candidates(scaled: torch.Tensor, top_k: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's `width` most likely tokens, best first, and their probabilities.

    A row with top-k renormalizes over its first k (the rest get probability 0); a row without keeps the
    probabilities of its whole distribution, so that top-p measures the nucleus against all of it.
    """
    values, ids = largest(scaled, width)
    parts = []
    truncated = [row for row, k in enumerate(top_k) if k > 0]
    if truncated:
        kept = _select(values, truncated)
        if any(top_k[row] < width for row in truncated):
            limit = torch.tensor([top_k[row] for row in truncated], device=scaled.device).unsqueeze(1)
            kept = kept.masked_fill(torch.arange(width, device=scaled.device) >= limit, float("-inf"))
        parts.append((truncated, torch.softmax(kept, dim=-1)))
    untruncated = [row for row, k in enumerate(top_k) if k == 0]
    if untruncated:
        full = torch.softmax(_select(scaled, untruncated), dim=-1)
        parts.append((untruncated, full.gather(1, _select(ids, untruncated))))
    return _merge(parts), ids


def _nucleus(probs: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Candidates (best first) outside each row's top-p nucleus get probability 0; the best one always stays."""
    if all(p >= 1.0 for p in top_p):
        return probs
    limit = torch.tensor([p if p < 1.0 else math.inf for p in top_p], device=probs.device).unsqueeze(1)
    outside = torch.cumsum(probs, dim=-1) - probs >= limit
    outside[:, 0] = False
    return probs.masked_fill(outside, 0.0)


def _crossings(probs: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's first position whose running sum of `probs` passes uniform × total ([rows, 1]), and the total.

    float32 CPU rows take the kernels' chunked sums (torch.ops.statelm.inverse_cdf: a few us where torch.cumsum and
    searchsorted take 50 over 49,152 probabilities); other rows torch's cumulative sums.
    """
    if sampling_kernels_take(probs):
        position, total = torch.ops.statelm.inverse_cdf(probs, uniforms)
        return position.unsqueeze(1), total
    cumulative = torch.cumsum(probs, dim=-1)
    total = cumulative[:, -1]
    return torch.searchsorted(cumulative, (uniforms * total).unsqueeze(1), right=True), total


def _invert(
    probs: torch.Tensor, ids: torch.Tensor | None, counts: torch.Tensor | int, uniforms: torch.Tensor
) -> torch.Tensor:
    """Each row's token by inverse CDF: where uniform × total falls in the cumulative sums of `probs`.

    `ids` names the candidates (None: positions are token ids); a position past a row's `counts` candidates
    (uniform × total rounded up to the total) falls back to its last one. A row whose total is not finite and
    positive (every token masked, NaN logits) gets -1.
    """
    position, total = _crossings(probs, uniforms)
    position.clamp_(max=counts - 1)
    tokens = (position if ids is None else ids.gather(1, position)).squeeze(1)
    return tokens.masked_fill_(~((total > 0.0) & (total < math.inf)), -1)
