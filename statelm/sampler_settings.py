"""The pydantic bases of every request body, and the sampling fields a server may default per model.

They live below the API (statelm/api/protocol.py builds on them) so that the settings (statelm/config.py) can check
`--default-sampling` as a request's fields are checked without importing the API.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StrictModel(BaseModel):
    """Rejects unknown fields and non-finite numbers, so nothing a client sends is silently dropped."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class TypedModel(StrictModel):
    """A StrictModel that also refuses a value of another JSON type (`true` for a number, `"yes"` for a boolean)."""

    model_config = ConfigDict(strict=True)


class SamplerSettings(TypedModel):
    """Sampling fields a server may default per model (`--default-sampling`, generation_config.json); None = unset."""

    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # -1 or 0: off
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(ge=0.01, le=10.0)] | None = None
    repetition_penalty_range: Annotated[int, Field(ge=-1)] | None = None  # -1: the whole context, 0: off

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """`"field": null` means the field's default, as in OpenAI's API; unknown fields are still rejected."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None or key not in cls.model_fields}
        return data
