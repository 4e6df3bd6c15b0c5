"""What a response carries of a vector: Matryoshka truncation with renormalisation, floats or base64."""

from __future__ import annotations

import base64

import numpy as np
import torch
import torch.nn.functional as F

from statelm.api.errors import APIError


def check_dimensions(requested: int | None, size: int, matryoshka: bool, model: str) -> None:
    """400 unless `dimensions` is absent, the model's own size, or (a Matryoshka model) smaller than it."""
    if requested is None or requested == size:
        return
    if requested > size:
        raise APIError(
            f"dimensions is {requested}, but `{model}` makes {size}-dimensional embeddings", param="dimensions"
        )
    if not matryoshka:
        raise APIError(
            f"`{model}` was not trained for shortened embeddings (Matryoshka); dimensions may only be {size}",
            param="dimensions",
        )


def shortened(vector: torch.Tensor, dimensions: int | None) -> torch.Tensor:
    """The first `dimensions` values renormalised to unit length (the whole vector when None)."""
    if dimensions is None or dimensions == vector.shape[0]:
        return vector
    return F.normalize(vector[:dimensions], dim=0)


def encoded(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    """The vector as floats, or as base64 of its little-endian float32 bytes (what OpenAI's SDK decodes)."""
    values = vector.float().numpy()
    if encoding_format == "base64":
        return base64.b64encode(values.astype("<f4").tobytes()).decode("ascii")
    return values.astype(np.float64).tolist()
