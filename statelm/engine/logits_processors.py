"""Batched logit transforms before sampling: logit bias, penalties, min-p, and the logprobs of a step.

Each function works on a [batch, vocab] float32 logits tensor with per-row parameters given as tensors or
lists, using whole-row torch ops (no Python loop over the vocabulary), and changes the tensor in place.
Rows never influence each other, and a row whose parameter is neutral (bias None, penalty 0 or 1, min_p 0)
is left bit-for-bit unchanged, so results do not depend on the batch a sequence shares.

Order per step, as vLLM and llama.cpp apply them: `apply_logit_bias` → min_tokens mask →
`apply_repetition_penalty` → `apply_presence_frequency_penalties` → grammar mask (`grammar.apply_bitmask`) →
forced token → `token_logprobs` (see there) → temperature → `apply_min_p` / top-k / top-p → sample. The
sampler (`statelm.engine.sampler`) runs that pipeline.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from statelm.kernels.build import kernels_available

LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for logit_bias values: [-100, 100]
MIN_LOGPROB = -9999.0  # what OpenAI reports for a token of zero probability (JSON has no -inf)


def token_counts(token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[batch, vocab] int32 count of each token id in each row's list (pass a slice for a trailing window)."""
    width = max((len(ids) for ids in token_lists), default=0)
    padded = torch.full((len(token_lists), width), vocab_size, dtype=torch.int64)  # pad id lands in a spare column
    for row, ids in enumerate(token_lists):
        if ids:
            padded[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.int64)
    counts = torch.zeros(len(token_lists), vocab_size + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones_like(padded, dtype=torch.int32, device=device))
    return counts[:, :vocab_size]


def apply_logit_bias(logits: torch.Tensor, biases: Sequence[Mapping[int, float] | None]) -> None:
    """Add each row's {token id: bias} (clamped to ±100, as OpenAI does) to its logits."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for row, bias in enumerate(biases):
        for token_id, value in (bias or {}).items():
            if not 0 <= token_id < logits.shape[1]:
                raise ValueError(f"logit_bias token id {token_id} is outside the vocabulary (0..{logits.shape[1] - 1})")
            rows.append(row)
            cols.append(token_id)
            values.append(value)
    if not rows:
        return
    device = logits.device
    bias_values = torch.tensor(values, dtype=logits.dtype, device=device).clamp_(-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)
    index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    logits.index_put_(index, bias_values, accumulate=True)


def apply_repetition_penalty(logits: torch.Tensor, counts: torch.Tensor, penalty: torch.Tensor) -> None:
    """HF/CTRL repetition penalty: a seen token's positive logit is divided by the penalty, a negative one multiplied.

    `counts` is `token_counts` of the context each row penalizes: prompt + output, or its trailing window
    (`tokens[-window:]`). `penalty` is [batch]; 1.0 leaves a row unchanged.
    """
    factor = penalty.to(logits.dtype).unsqueeze(1)
    penalized = torch.where(logits > 0, logits / factor, logits * factor)
    logits.copy_(torch.where(counts > 0, penalized, logits))


def apply_presence_frequency_penalties(
    logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
) -> None:
    """OpenAI penalties: subtract `frequency * count + presence * (count > 0)` over the output tokens' counts."""
    counts = counts.to(logits.dtype)
    penalty = counts * frequency.to(logits.dtype).unsqueeze(1) + (counts > 0) * presence.to(logits.dtype).unsqueeze(1)
    logits.sub_(penalty)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop (-inf) tokens whose probability is below `min_p` times the top token's; `min_p` is [batch], 0 = off.

    Apply to temperature-scaled logits; the test `logit < max + log(min_p)` is the probability test in log space.
    """
    threshold = logits.max(dim=-1, keepdim=True).values + torch.log(min_p.to(logits.dtype)).unsqueeze(1)
    logits.masked_fill_(logits < threshold, float("-inf"))


class TokenLogprobs(NamedTuple):
    """Logprobs of one step: the chosen token's [batch], and the top-k ids and logprobs [batch, k], best first."""

    chosen: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


def token_logprobs(logits: torch.Tensor, chosen_ids: torch.Tensor, num_top: int) -> TokenLogprobs:
    """Log-softmax of `logits`: the logprob of each row's chosen token and the `num_top` most likely tokens.

    statelm reports logprobs of the processed distribution as vLLM's `processed_logprobs` mode describes it,
    taken after logit bias, penalties, the grammar mask and a forced token but before temperature and
    top-k/top-p/min-p: so they are the distribution the sampler starts from, they do not change with
    temperature (as OpenAI's do not), and greedy requests have them too. Pass the logits at that point;
    `num_top` is the batch's largest `top_logprobs` (0-20), each row keeps its own first k. -inf (a masked
    token) is reported as -9999.0.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1).clamp_(min=MIN_LOGPROB)
    chosen = logprobs.gather(1, chosen_ids.view(-1, 1).to(device=logits.device, dtype=torch.int64)).squeeze(1)
    top_values, top_ids = largest(logprobs, min(num_top, logprobs.shape[1]))
    return TokenLogprobs(chosen=chosen, top_ids=top_ids, top_logprobs=top_values)


def sampling_kernels_take(rows: torch.Tensor) -> bool:
    """Whether the kernels' passes over whole rows (torch.ops.statelm.top_k, inverse_cdf) take these: float32 CPU
    rows, where the kernels are loaded."""
    return rows.device.type == "cpu" and rows.dtype == torch.float32 and kernels_available()


def largest(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest values, best first, and their ids: a NaN first, as torch.topk ranks it.

    float32 CPU rows take the kernels' one pass over a row (torch.ops.statelm.top_k, equal values by lower id),
    which reads the row at memory speed where torch.topk copies and selects among all of it (91 us for 49,152
    logits, one thread); other rows take torch.topk.
    """
    if k > 0 and sampling_kernels_take(rows):
        values, ids = torch.ops.statelm.top_k(rows, k)
        return values, ids
    values, ids = torch.topk(rows, k, dim=-1)
    return values, ids
