"""Row chunking makes every row's projection independent of the other rows in the batch."""

from __future__ import annotations

import pytest
import torch

from statelm.models.layers import RowChunking, chunked_linear

pytestmark = [pytest.mark.invariance]


def rows_alone_and_batched(linear: object, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    alone = torch.cat([linear(x[i : i + 1]) for i in range(x.shape[0])])
    return alone, linear(x)


def test_fixed_chunks_give_each_row_the_same_bits_in_any_batch() -> None:
    torch.manual_seed(0)
    weight = (torch.randn(576, 576) * 0.02).bfloat16()  # a shape whose kernel changes with the row count
    x = torch.randn(35, 576).bfloat16()
    alone, batched = rows_alone_and_batched(lambda rows: chunked_linear(rows, weight, None, 16), x)
    assert torch.equal(alone, batched)


def test_prompt_and_generated_rows_each_use_their_own_chunk() -> None:
    torch.manual_seed(1)
    weight = (torch.randn(192, 64) * 0.1).bfloat16()
    bias = torch.randn(192).bfloat16()
    x = torch.randn(40, 64).bfloat16()
    chunking = RowChunking(generated=4, prompt=16)
    is_prompt = torch.tensor([i % 3 != 0 for i in range(40)])
    chunking.set_rows(is_prompt)
    mixed = chunking.linear(x, weight, bias)
    prompt_rows, generated_rows = is_prompt.nonzero().squeeze(1), (~is_prompt).nonzero().squeeze(1)
    assert torch.equal(mixed[prompt_rows], chunked_linear(x[prompt_rows], weight, bias, 16))
    assert torch.equal(mixed[generated_rows], chunked_linear(x[generated_rows], weight, bias, 4))
    chunking.set_rows(None)
    assert torch.equal(chunking.linear(x, weight, bias), chunked_linear(x, weight, bias, 4))
    chunking.set_rows(torch.ones(40, dtype=torch.bool))
    assert torch.equal(chunking.linear(x, weight, bias), chunked_linear(x, weight, bias, 16))


def test_a_share_of_the_batch_keeps_each_rows_kind() -> None:
    chunking = RowChunking(generated=4, prompt=16)
    chunking.set_rows(torch.tensor([True, False, True, True, False, False]))
    prompt, generated = chunking.rows_among(torch.tensor([1, 2, 4, 5]))
    assert prompt is not None and generated is not None
    assert prompt.tolist() == [1] and generated.tolist() == [0, 2, 3]
    prompt, generated = chunking.rows_among(torch.tensor([0, 3]))
    assert prompt is not None and prompt.tolist() == [0, 1] and generated is None  # all prompt rows
    assert chunking.rows_among(torch.tensor([1, 4])) == (None, None)  # all generated
    chunking.set_rows(None)
    assert chunking.rows_among(torch.tensor([0, 1])) == (None, None)
