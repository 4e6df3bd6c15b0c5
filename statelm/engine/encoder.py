"""Runs an encoder model on its own thread: the inputs of every waiting request go through it together, in forwards
of at most a token budget, and each request gets its vectors back on its event loop."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field

import torch

from statelm.engine.futures import settle
from statelm.models.bert import BertEncoder
from statelm.models.pooling import Pooling, pooled

log = logging.getLogger(__name__)


@dataclass
class EncoderJob:
    """One request's inputs (token ids and where a pair's second segment starts) and the future of its vectors."""

    ids: list[list[int]]
    second_segments: list[int | None]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[torch.Tensor]]
    results: list[torch.Tensor] = field(default_factory=list)


class EncoderEngine:
    """An encoder and the thread that batches its requests; an embedding model's vectors are pooled and
    normalised, a cross-encoder's are its logits."""

    def __init__(self, model: BertEncoder, pooling: Pooling, max_queue: int = 256, max_batch_tokens: int = 8192):
        self.model = model
        self.pooling = pooling
        self.max_queue = max_queue
        self.max_batch_tokens = max_batch_tokens
        self._jobs: queue.Queue[EncoderJob | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="statelm-encoder", daemon=True)
        self._thread.start()

    def queue_is_full(self) -> bool:
        """True when max_queue requests already wait."""
        return self._jobs.qsize() >= self.max_queue

    async def run(self, ids: list[list[int]], second_segments: list[int | None]) -> list[torch.Tensor]:
        """One float32 vector per input."""
        loop = asyncio.get_running_loop()
        job = EncoderJob(ids, second_segments, loop, loop.create_future())
        self._jobs.put(job)
        return await job.future

    def shutdown(self) -> None:
        """Stop the thread after the batch in progress."""
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            jobs = [self._jobs.get()]
            while not self._jobs.empty():
                jobs.append(self._jobs.get_nowait())
            if None in jobs:
                return
            live = [job for job in jobs if job is not None and not job.future.cancelled()]
            try:
                self._compute(live)
            except Exception as exc:  # the batch's requests fail; the thread goes on
                log.exception("encoder batch failed")
                for job in live:
                    job.loop.call_soon_threadsafe(settle, job.future, None, exc)
                continue
            for job in live:
                job.loop.call_soon_threadsafe(settle, job.future, job.results, None)

    def _compute(self, jobs: list[EncoderJob]) -> None:
        """Fill every job's results, in forwards of at most max_batch_tokens tokens (a longer input alone)."""
        items = [(job, i) for job in jobs for i in range(len(job.ids))]
        for job in jobs:
            job.results = [torch.empty(0)] * len(job.ids)
        batch: list[tuple[EncoderJob, int]] = []
        tokens = 0
        for job, i in items:
            length = len(job.ids[i])
            if batch and tokens + length > self.max_batch_tokens:
                self._forward(batch)
                batch, tokens = [], 0
            batch.append((job, i))
            tokens += length
        if batch:
            self._forward(batch)

    @torch.inference_mode()
    def _forward(self, batch: list[tuple[EncoderJob, int]]) -> None:
        """Run one flat batch and store each input's vector."""
        seqs = [job.ids[i] for job, i in batch]
        lengths = [len(ids) for ids in seqs]
        types = []
        for (job, i), length in zip(batch, lengths, strict=True):
            start = job.second_segments[i]
            types.extend([0] * length if start is None else [0] * start + [1] * (length - start))
        hidden = self.model(
            torch.tensor([token for ids in seqs for token in ids]),
            torch.cat([torch.arange(length) for length in lengths]),
            torch.tensor(types),
            lengths,
        )
        rows = hidden.split(lengths)
        if self.model.config.num_labels:
            logits = self.model.classify(torch.stack([row[0] for row in rows]))
            vectors = list(logits)
        else:
            vectors = [pooled(row, self.pooling) for row in rows]
        for (job, i), vector in zip(batch, vectors, strict=True):
            job.results[i] = vector
