"""The API layer against a fake engine: what chat and responses ask of the EngineClient, and what they make of its
outputs (no model: the fake's replies are token ids of the tiny models' tokenizer)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest

from statelm.api.conversation import ConversationService
from statelm.api.errors import APIError
from statelm.api.openai.chat import ChatService
from statelm.api.protocol import ChatCompletionRequest
from statelm.api.responses.protocol import ResponsesRequest
from statelm.api.responses.service import ResponsesService
from statelm.api.serving import ServedModel, ServingContext
from statelm.config import SessionDurability
from statelm.engine.client import EngineError, EngineStats
from statelm.metrics import ServingMetrics
from statelm.sessions.manager import SessionManager
from statelm.sessions.session import SessionSettings
from statelm.tokenizer import Tokenizer
from tests.models.tiny_model_dir import write_chatml_tokenizer
from tests.unit.fake_engine import FINGERPRINT, FakeEngine
from tests.unit.memory_state_store import MemoryStore

REPLY = "Paris is the capital of France."
T = TypeVar("T")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The tiny models' ChatML tokenizer."""
    path: Path = tmp_path_factory.mktemp("tokenizer")
    write_chatml_tokenizer(path)
    return Tokenizer.from_hf_dir(path)


def serve(tokenizer: Tokenizer, engine: FakeEngine, work: Callable[[ChatService], Awaitable[T]]) -> T:
    """Run work on a chat service (with sessions) over engine."""
    return converse(tokenizer, engine, lambda conversations: work(ChatService(conversations)))


def converse(tokenizer: Tokenizer, engine: FakeEngine, work: Callable[[ConversationService], Awaitable[T]]) -> T:
    """Run work on the conversation core (with sessions) over engine, as chat, responses and messages share it."""

    async def run() -> T:
        manager = SessionManager(engine, "tiny", FINGERPRINT, MemoryStore(), SessionDurability.OFF)
        await manager.start()
        model = ServedModel(name="tiny", aliases=frozenset(), max_model_len=engine.info.max_model_len, created=0)
        try:
            context = ServingContext(engine, tokenizer, model, ServingMetrics(engine))
            return await work(ConversationService(context, manager))
        finally:
            await manager.close()

    return asyncio.run(run())


def request(content: str, **fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "tiny", "messages": [{"role": "user", "content": content}], **fields}
    )


def test_a_reply_is_the_engines_tokens_as_text_with_the_engines_counts(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(reply=tokenizer.encode(REPLY, add_special_tokens=False))
    response = serve(tokenizer, engine, lambda chat: chat.complete(request("Capital of France?", max_tokens=50)))
    (sent,) = engine.requests
    assert response.choices[0].message.content == REPLY
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.prompt_tokens == len(sent.prompt_ids) and sent.session_id is None
    assert response.usage.completion_tokens == len(engine.reply)
    assert tokenizer.decode(sent.prompt_ids, skip_special_tokens=False).startswith("<|im_start|>user\nCapital")


def test_max_tokens_reaches_the_engine_and_a_cut_reply_ends_by_length(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(reply=tokenizer.encode(REPLY, add_special_tokens=False))
    response = serve(tokenizer, engine, lambda chat: chat.complete(request("Capital?", max_tokens=3)))
    assert engine.requests[0].params.max_tokens == 3
    assert response.choices[0].finish_reason == "length" and response.usage.completion_tokens == 3


def test_a_full_queue_is_refused_before_the_engine_sees_the_request(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(reply=[1], full=True)
    with pytest.raises(APIError) as refused:
        serve(tokenizer, engine, lambda chat: chat.complete(request("Hi")))
    assert refused.value.status == 429 and engine.requests == []


def test_a_session_turn_starts_from_the_sessions_kv_and_commits_into_it(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(reply=tokenizer.encode(REPLY, add_special_tokens=False))

    async def work(chat: ChatService) -> list[int]:
        manager = chat.conversations.manager()
        session = await manager.create("s", SessionSettings())
        cached = []
        for question in ("Capital of France?", "And of Germany?"):
            response = await chat.complete(request(question, session_id="s"))
            assert response.usage.prompt_tokens_details is not None
            cached.append(response.usage.prompt_tokens_details.cached_tokens)
        assert [message["role"] for message in session.transcript] == ["user", "assistant"] * 2
        assert session.transcript[1]["content"] == REPLY
        return cached

    cached = serve(tokenizer, engine, work)
    first, second = engine.requests
    assert first.session_id == second.session_id == "s"
    assert engine.committed == [(first.request_id, "s"), (second.request_id, "s")]
    assert cached[0] == 0 and cached[1] >= len(first.prompt_ids)  # the first exchange came from the session's KV
    assert engine.resident["s"].tokens == [*second.prompt_ids, *engine.reply]


def test_an_engine_failure_fails_the_request_and_drops_the_session_turn(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(reply=[1], fail_with="engine error: out of memory")

    async def work(chat: ChatService) -> list[dict[str, object]]:
        session = await chat.conversations.manager().create("s", SessionSettings())
        with pytest.raises(EngineError, match="out of memory"):
            await chat.complete(request("Hi", session_id="s"))
        assert not session.busy
        return session.transcript

    assert serve(tokenizer, engine, work) == []
    assert engine.committed == [] and engine.discarded == [engine.requests[0].request_id]


def test_metrics_read_the_engines_stats(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(reply=[1])
    engine._stats = EngineStats(
        running=3,
        waiting=2,
        kv_blocks_used=5,
        prefix_queried_tokens=10,
        prefix_hit_tokens=4,
        draft_tokens=8,
        draft_tokens_accepted=5,
    )
    text = ServingMetrics(engine).render().decode()
    for line in (
        "statelm_requests_running 3.0",
        "statelm_requests_waiting 2.0",
        "statelm_kv_blocks_used 5.0",
        "statelm_prefix_cache_hit_rate 0.4",
        "statelm_draft_tokens_total 8.0",
        "statelm_draft_tokens_accepted_total 5.0",
    ):
        assert line in text


def test_a_stream_is_a_role_chunk_the_replys_text_and_a_finish_chunk(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(reply=tokenizer.encode(REPLY, add_special_tokens=False))

    async def work(chat: ChatService) -> list[tuple[str | None, str | None]]:
        chunks = await chat.stream(request("Capital of France?", stream=True))
        return [(chunk.choices[0].delta.content, chunk.choices[0].finish_reason) async for chunk in chunks]

    chunks = serve(tokenizer, engine, work)
    assert chunks[0] == ("", None) and chunks[-1] == (None, "stop")
    assert "".join(content or "" for content, _ in chunks) == REPLY
    assert engine.aborted == []


def test_a_session_turn_whose_stream_is_cancelled_aborts_the_request_and_leaves_the_session_as_it_was(
    tokenizer: Tokenizer,
) -> None:
    engine = FakeEngine(reply=tokenizer.encode(REPLY, add_special_tokens=False))

    async def work(chat: ChatService) -> None:
        session = await chat.conversations.manager().create("s", SessionSettings())
        chunks = await chat.stream(request("Capital of France?", session_id="s", stream=True))
        started = asyncio.Event()

        async def read() -> None:  # the server's response task, cancelled when the client goes away
            async for _ in chunks:
                started.set()

        reader = asyncio.create_task(read())
        await started.wait()
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        await chat.conversations.manager().settled(session)
        assert session.transcript == [] and not session.busy

    serve(tokenizer, engine, work)
    (sent,) = engine.requests
    assert engine.aborted == [(sent.request_id, None)]
    assert engine.committed == [] and engine.discarded == [sent.request_id]


def test_a_response_continued_by_previous_response_id_starts_from_its_chains_kv(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(reply=tokenizer.encode(REPLY, add_special_tokens=False))

    async def work(conversations: ConversationService) -> list[str]:
        responses = ResponsesService(conversations)
        await responses.start()
        first = await responses.create(ResponsesRequest(model="tiny", input="Capital of France?"))
        second = await responses.create(
            ResponsesRequest(model="tiny", input="And of Germany?", previous_response_id=first.id)
        )
        assert second.usage is not None and first.usage is not None
        assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
        return [first.output_text, second.output_text]

    assert converse(tokenizer, engine, work) == [REPLY, REPLY]
    first, second = engine.requests
    assert first.session_id is not None and second.session_id == first.session_id  # the chain's session
    assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids
    assert [session for _, session in engine.committed] == [first.session_id] * 2
