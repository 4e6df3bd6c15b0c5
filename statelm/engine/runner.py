"""Turns a step's scheduled chunks into one flat forward pass and returns the logits that sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from statelm.attention.base import AttentionMetadata
from statelm.engine.cuda_graphs import DecodeGraphs
from statelm.engine.kv_cache import KVCache
from statelm.engine.scheduler import ScheduledChunk
from statelm.engine.sequence import Sequence
from statelm.models.llama import LlamaForCausalLM


@dataclass
class ForwardResult:
    """Logits for the sequences whose last token was computed this step, in the same order: a row each, then the
    rows of their drafts' tokens, sequence after sequence."""

    sampling_seqs: list[Sequence]
    logits: torch.Tensor  # [len(sampling_seqs) + their drafts' tokens, vocab] float32

    def draft_logits(self) -> dict[Sequence, torch.Tensor]:
        """The logits of each draft's rows (a row predicts the token after its draft token), by sequence."""
        drafts: dict[Sequence, torch.Tensor] = {}
        start = len(self.sampling_seqs)
        for seq in self.sampling_seqs:
            if seq.draft:
                drafts[seq] = self.logits[start : start + len(seq.draft)]
                start += len(seq.draft)
        return drafts


class ModelRunner:
    """Owns the model and the KV cache tensors; runs one batched forward per step.

    With `cuda_graphs` (a CUDA device on a graph-safe compute path), steps that only decode replay a captured
    graph of their batch-size bucket; other steps (any prompt row) run eagerly.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        device: torch.device,
        *,
        cuda_graphs: bool = False,
        max_num_seqs: int = 64,
        max_model_len: int = 0,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs:
            self.graphs = DecodeGraphs(self._logits_of, max_num_seqs, max_model_len, self.block_size, device)
            with torch.inference_mode():
                self.graphs.capture()

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> ForwardResult:
        """Run every chunk through the model in one forward and compute logits where a token is sampled."""
        if self.graphs is not None and self._replayable(chunks):
            seqs = [chunk.seq for chunk in chunks]
            logits = self.graphs.replay(
                [seq.tokens[seq.num_computed_tokens] for seq in seqs],
                [seq.num_computed_tokens for seq in seqs],
                [seq.block_table.blocks for seq in seqs],
                [seq.num_computed_tokens + 1 for seq in seqs],
            )
            return ForwardResult(seqs, logits)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []  # where each token's K/V goes: its block * block_size + its offset in the block
        query_lens: list[int] = []
        seq_lens: list[int] = []
        query_start = [0]
        sample_rows: list[int] = []
        sampling_seqs: list[Sequence] = []
        draft_rows: list[int] = []  # rows of the drafts' tokens (ForwardResult.draft_logits)
        is_prompt: list[bool] = []
        tables: list[list[int]] = []
        size = self.block_size
        for chunk in chunks:
            seq, start = chunk.seq, chunk.seq.num_computed_tokens
            end = start + chunk.num_tokens
            blocks = seq.block_table.blocks
            input_ids.extend(seq.tokens[start:end])
            input_ids.extend(seq.draft)  # a draft follows the chunk's last token (Scheduler._keep_draft)
            positions.extend(range(start, end))
            slots.extend(blocks[position // size] * size + position % size for position in range(start, end))
            prompt_len = len(seq.prompt_ids)
            is_prompt.extend(position < prompt_len for position in range(start, end))
            tables.append(blocks)
            query_lens.append(chunk.num_tokens)
            seq_lens.append(end)
            query_start.append(query_start[-1] + chunk.num_tokens)
            if end == seq.num_tokens + len(seq.draft) and seq.samples:
                sample_rows.append(query_start[-1] - 1 - len(seq.draft))
                sampling_seqs.append(seq)
                draft_rows.extend(range(query_start[-1] - len(seq.draft), query_start[-1]))
        width = max(len(blocks) for blocks in tables)
        block_tables = torch.tensor([blocks + [0] * (width - len(blocks)) for blocks in tables], dtype=torch.int64)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            block_tables=block_tables.to(self.device),
            query_lens=query_lens,
            seq_lens=seq_lens,
            query_start=query_start,
        )
        prompt_rows = torch.tensor(is_prompt)  # on the host: the row chunking reads it without a device sync
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            self.kv_cache,
            meta,
            prompt_rows,
        )
        for chunk, start in zip(chunks, query_start, strict=False):
            if chunk.seq.pooled is not None:
                chunk.seq.pooled.add(hidden[start : start + chunk.num_tokens], chunk.seq.num_computed_tokens)
        rows = torch.tensor(sample_rows + draft_rows, dtype=torch.int64)
        logits = self.model.compute_logits(hidden[rows.to(self.device)], prompt_rows[rows])
        return ForwardResult(sampling_seqs, logits)

    def _logits_of(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The captured decode step: every row a generated token that samples."""
        return self.model.compute_logits(self.model(input_ids, positions, self.kv_cache, meta, None))

    def _replayable(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether the step only decodes: one generated token per sequence, each of which samples."""
        assert self.graphs is not None
        longest = 0
        for chunk in chunks:
            seq = chunk.seq
            position = seq.num_computed_tokens
            if chunk.num_tokens != 1 or position < len(seq.prompt_ids) or position + 1 != seq.num_tokens:
                return False
            longest = max(longest, position + 1)
        return self.graphs.fits(len(chunks), longest)
