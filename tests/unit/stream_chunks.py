"""Ways to cut a model output into stream chunks: whole, at every single boundary, per character, at random."""

from __future__ import annotations

import random
from collections.abc import Iterator


def chunkings(text: str, *, seed: int = 0, random_cuts: int = 10) -> Iterator[list[str]]:
    """Every way a parser must treat alike: one chunk, each two-chunk split, one character per chunk, random cuts."""
    yield [text]
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(random_cuts if len(text) > 2 else 0):
        cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(1, min(8, len(text) - 1))))
        yield [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True)]
