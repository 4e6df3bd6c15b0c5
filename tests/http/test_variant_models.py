"""A Llama variant served as `statelm serve` serves it: a tiny Gemma 2 GGUF (Gemma-style chat template and control
tokens) answers through the official SDK, and its template's refusal of a system message is a 400 that loses
nothing."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from statelm.kernels.build import kernels_available
from tests.http.conftest import SERVED_NAME, InProcessServer, serve_in_process, tiny_args
from tests.models.tiny_checkpoints import make_tiny_checkpoint
from tests.models.tiny_gguf import gemma_style_vocab, write_gguf_from_checkpoint


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    folder = tmp_path_factory.mktemp("gemma2-gguf")
    checkpoint = make_tiny_checkpoint("gemma2", folder / "hf", query_pre_attn_scalar=16, max_position_embeddings=512)
    model = write_gguf_from_checkpoint(checkpoint, folder / "gemma2.gguf", tokenizer=gemma_style_vocab)
    with serve_in_process(tiny_args(model, folder / "state")) as server:
        yield server


def test_a_gemma2_gguf_answers_and_refuses_a_system_message_with_a_400(gemma: InProcessServer) -> None:
    client = gemma.openai()
    messages = [{"role": "user", "content": "Hello there"}]
    reply = client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=6, temperature=0)
    again = client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=6, temperature=0)
    assert reply.choices[0].message.content == again.choices[0].message.content
    assert reply.usage.prompt_tokens == 4 + len("user\nHello there\nmodel\n")  # 4 control tokens, then bytes
    with pytest.raises(openai.BadRequestError, match="System role not supported"):
        client.chat.completions.create(
            model=SERVED_NAME, messages=[{"role": "system", "content": "Be brief."}, *messages]
        )
    health = gemma.http().get("/health").json()
    assert health["batch_invariance"]["path"] == ("kernels" if kernels_available() else "torch")  # soft-capped too
