"""The sampling defaults statelm ships for the bundled model, found under the names its files go by."""

from __future__ import annotations

import pytest

from statelm.engine.builder import model_card_defaults


@pytest.mark.parametrize(
    "name",
    [
        "SmolLM2-135M-Instruct",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "SmolLM2-135M-Instruct.Q4_1",
        "smollm2-135m-instruct-q8_0",
    ],
)
def test_the_bundled_model_gets_its_defaults(name: str) -> None:
    assert model_card_defaults(name) == {"temperature": 0.0, "top_p": 0.9}


@pytest.mark.parametrize("name", ["SmolLM2-1.7B-Instruct", "SmolLM2-135M", "Qwen3-0.6B", "my-SmolLM2-135M-Instruct"])
def test_other_models_keep_openai_defaults(name: str) -> None:
    assert model_card_defaults(name) == {}
