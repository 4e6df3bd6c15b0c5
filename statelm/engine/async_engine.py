"""Runs the engine's step loop on its own thread and streams each request's outputs to asyncio."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from statelm.engine.engine import Engine, StepOutput
from statelm.engine.sequence import FinishReason, SamplingParams
from statelm.engine.session_kv import SessionKVData
from statelm.models.pooling import PooledRows

T = TypeVar("T")
DEGRADED_AFTER_FAILED_STEPS = 3

log = logging.getLogger(__name__)


@dataclass
class _Subscriber:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[StepOutput]


class EngineError(RuntimeError):
    """A request failed inside the engine."""


class AsyncEngine:
    """Thread-safe front of Engine: requests go in through a queue, outputs come back per request."""

    def __init__(self, engine: Engine, max_queue: int) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self._unfinished = 0  # generate() calls in progress, changed on the event loop only
        self._commands: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._subscribers: dict[str, _Subscriber] = {}
        self._thread = threading.Thread(target=self._run, name="statelm-engine", daemon=True)
        self._thread.start()

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        session_id: str | None = None,
        restore: SessionKVData | None = None,
    ) -> AsyncIterator[StepOutput]:
        """Yield the step outputs of the request's choices until all have finished; leaving early aborts it."""

        def add() -> None:
            self.engine.add_request(request_id, prompt_ids, params, session_id, restore)

        async for output in self._outputs(request_id, add, len(prompt_ids), params.n):
            yield output

    async def embed(self, request_id: str, prompt_ids: list[int], pooled: PooledRows) -> StepOutput:
        """Run a prompt and pool its hidden states; the output holds the vector in `embedding`."""

        def add() -> None:
            self.engine.add_embedding(request_id, prompt_ids, pooled)

        async with contextlib.aclosing(self._outputs(request_id, add, len(prompt_ids), 1)) as outputs:
            async for output in outputs:
                return output
        raise EngineError("the embedding ended without a result")

    async def _outputs(
        self, request_id: str, add: Callable[[], None], num_prompt_tokens: int, choices: int
    ) -> AsyncIterator[StepOutput]:
        """Queue a request (`add`, run on the engine thread) and yield its outputs until its choices have finished;
        leaving early aborts it."""
        subscriber = _Subscriber(asyncio.get_running_loop(), asyncio.Queue())
        self._subscribers[request_id] = subscriber

        def start() -> None:
            try:
                add()
            except Exception as exc:  # the request fails alone; the engine goes on
                log.exception("cannot start request %s", request_id)
                error = f"cannot start the request: {exc}"
                self._publish([StepOutput(request_id, [], True, FinishReason.ABORT, num_prompt_tokens, 0, error=error)])

        self._commands.put(start)
        self._unfinished += 1
        unfinished = choices
        try:
            while unfinished:
                output = await subscriber.outputs.get()
                if output.error is not None:
                    unfinished = 0  # the engine has dropped the whole request
                    raise EngineError(output.error)
                if output.finished:
                    unfinished -= 1
                yield output
        finally:
            self._unfinished -= 1
            self._subscribers.pop(request_id, None)
            if unfinished:
                self.abort(request_id)

    def submit(self, function: Callable[[], object]) -> None:
        """Run function on the engine thread, between steps, without waiting for it."""
        self._commands.put(function)

    async def call(self, function: Callable[[], T]) -> T:
        """Run function on the engine thread, between steps, and return its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def settle(result: T | None, error: Exception | None) -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)  # type: ignore[arg-type]

        def command() -> None:
            try:
                result = function()
            except Exception as exc:
                loop.call_soon_threadsafe(settle, None, exc)
            else:
                loop.call_soon_threadsafe(settle, result, None)

        self._commands.put(command)
        return await future

    def is_degraded(self) -> bool:
        """True when the engine cannot serve: its thread died, or its last forward passes all failed."""
        return not self._thread.is_alive() or self.engine.failed_steps_in_a_row >= DEGRADED_AFTER_FAILED_STEPS

    def queue_is_full(self) -> bool:
        """True when max_queue requests already wait for a slot in the running batch."""
        return self._unfinished - len(self.engine.scheduler.running) >= self.max_queue

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Ask the engine thread to drop a request (or only its choice `index`) at its next step."""
        self._commands.put(lambda: self.engine.abort(request_id, index))

    def shutdown(self) -> None:
        """Stop the engine thread after the command in progress."""
        self._commands.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            try:
                if not self._drain_commands(block=not self.engine.has_work()):
                    return
                self._publish(self.engine.step())
            except Exception:  # keep serving: a bug in one step must not kill the thread
                log.exception("engine loop error")

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if block, until a cache pin may expire); False when asked to stop."""
        try:
            timeout = self.engine.pool.pins.seconds_to_next_expiry() if block else None
            command = self._commands.get(block=block, timeout=timeout)
        except queue.Empty:
            return True
        while True:
            if command is None:
                return False
            command()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _publish(self, outputs: list[StepOutput]) -> None:
        for output in outputs:
            subscriber = self._subscribers.get(output.request_id)
            if subscriber is not None:
                subscriber.loop.call_soon_threadsafe(subscriber.outputs.put_nowait, output)
