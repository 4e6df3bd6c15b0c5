"""Drive a synchronous engine to completion, for tests that check model output without a server."""

from __future__ import annotations

from statelm.engine.engine import Engine
from statelm.engine.sequence import SamplingParams


def generate(engine: Engine, prompts: dict[str, list[int]], params: SamplingParams) -> dict[str, list[int]]:
    """Run every prompt together through the engine; return each request's generated token ids."""
    outputs: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    for request_id, prompt_ids in prompts.items():
        engine.add_request(request_id, prompt_ids, params)
    while engine.has_work():
        for step in engine.step():
            assert step.error is None, step.error
            outputs[step.request_id].extend(step.new_token_ids)
    return outputs
