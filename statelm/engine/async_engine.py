"""The in-process EngineClient: runs the engine's step loop on its own thread and streams outputs to asyncio."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from statelm.engine.client import (
    EngineError,
    EngineInfo,
    EngineRequest,
    EngineStats,
    FinishReason,
    RequestOutput,
    SessionKVData,
    SpillHandler,
)
from statelm.engine.engine import Engine
from statelm.engine.futures import settle
from statelm.host_allocator import release_free_memory
from statelm.models.pooling import PooledRows

T = TypeVar("T")
DEGRADED_AFTER_FAILED_STEPS = 3

log = logging.getLogger(__name__)


@dataclass
class _Subscriber:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[RequestOutput]


class AsyncEngine:
    """The EngineClient of an engine in this process: commands go to its thread through a queue, each request's
    outputs come back to the event loop that asked for them."""

    def __init__(self, engine: Engine, max_queue: int, batch_invariance: Mapping[str, object] | None = None) -> None:
        self.engine = engine
        kv_cache = engine.runner.kv_cache
        self.info = EngineInfo(
            max_model_len=engine.max_model_len,
            max_queue=max_queue,
            block_size=engine.pool.block_size,
            prefix_caching=engine.pool.enable_prefix_caching,
            sampling_defaults=engine.sampling_defaults,
            device=engine.runner.device.type,
            kv_format=kv_cache.format.name,
            kv_bytes_per_token=kv_cache.bytes_per_token,
            kv_capacity_tokens=kv_cache.num_blocks * kv_cache.block_size,
            batch_invariance=batch_invariance,
        )
        self._unfinished = 0  # generate() calls in progress, changed on the event loop only
        self._commands: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._subscribers: dict[str, _Subscriber] = {}
        self._thread = threading.Thread(target=self._run, name="statelm-engine", daemon=True)
        self._thread.start()

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Yield the outputs of the request's choices until all have finished; leaving early aborts it."""

        def add() -> None:
            self.engine.add_request(
                request.request_id, request.prompt_ids, request.params, request.session_id, request.restore
            )

        async for output in self._outputs(request.request_id, add, len(request.prompt_ids), request.params.n):
            yield output

    async def embed(self, request_id: str, prompt_ids: list[int], pooled: PooledRows) -> RequestOutput:
        """Run a prompt and pool its hidden states; the output holds the vector in `embedding`."""

        def add() -> None:
            self.engine.add_embedding(request_id, prompt_ids, pooled)

        async with contextlib.aclosing(self._outputs(request_id, add, len(prompt_ids), 1)) as outputs:
            async for output in outputs:
                return output
        raise EngineError("the embedding ended without a result")

    async def _outputs(
        self, request_id: str, add: Callable[[], None], num_prompt_tokens: int, choices: int
    ) -> AsyncIterator[RequestOutput]:
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
                failed = RequestOutput(request_id, [], True, FinishReason.ABORT, num_prompt_tokens, 0, error=error)
                self._publish([failed])

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

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Ask the engine thread to drop a request (or only its choice `index`) at its next step."""
        self._submit(lambda: self.engine.abort(request_id, index))

    def queue_is_full(self) -> bool:
        """True when max_queue requests already wait for a slot in the running batch."""
        return self._unfinished - self.engine.latest_stats.running >= self.info.max_queue

    def is_degraded(self) -> bool:
        """True when the engine cannot serve: its thread died, or its last forward passes all failed."""
        return not self._thread.is_alive() or self.engine.failed_steps_in_a_row >= DEGRADED_AFTER_FAILED_STEPS

    def stats(self) -> EngineStats:
        """The engine's state as its latest step (which follows any command) left it or is running it."""
        return self.engine.latest_stats

    def commit_turn(self, request_id: str, session_id: str) -> None:
        """Make a session turn's KV the session's, after the commands sent before."""
        self._submit(lambda: self.engine.commit_turn(request_id, session_id))

    def discard_turn(self, request_id: str) -> None:
        """Drop a session turn's KV, after the commands sent before."""
        self._submit(lambda: self.engine.discard_turn(request_id))

    async def resident_sessions(self, session_ids: list[str]) -> dict[str, int]:
        """The token counts of those sessions whose KV is in the pool."""

        def lengths() -> dict[str, int]:
            counts = {session_id: self.engine.sessions.num_tokens(session_id) for session_id in session_ids}
            return {session_id: count for session_id, count in counts.items() if count is not None}

        return await self._call(lengths)

    async def export_session_kv(self, session_id: str) -> SessionKVData | None:
        """A copy of a resident session's KV, taken once a refresh of its decoded tail that is due has run (so that
        it holds the whole conversation); None if it is not resident."""
        return await self._call(lambda: self.engine.sessions.export(session_id), after_refresh_of=session_id)

    async def load_session_kv(self, session_id: str, data: SessionKVData) -> None:
        """Put a session's KV into the pool; SessionKVError if it cannot fit."""
        await self._call(lambda: self.engine.sessions.load(session_id, data))

    async def fork_session_kv(self, source_id: str, target_id: str) -> bool:
        """Give target the KV of source, sharing its blocks; False if source is not resident."""
        return await self._call(lambda: self.engine.sessions.fork(source_id, target_id))

    def release_session_kv(self, session_id: str) -> None:
        """Forget a session's KV, after the commands sent before."""
        self._submit(lambda: self.engine.sessions.release(session_id))

    def empty_session_kv(self) -> SessionKVData:
        """The KV of no tokens, shaped as the pool's."""
        return SessionKVData([], *self.engine.kv.kv_cache.gather([], 0))

    def on_spill(self, handler: SpillHandler | None) -> None:
        """Hand the KV of sessions spilled under pressure to handler, on the calling event loop (None: no spills)."""
        sessions = self.engine.sessions
        if handler is None:
            sessions.spill_handler = None
            return
        loop = asyncio.get_running_loop()
        sessions.spill_handler = lambda session_id, data: loop.call_soon_threadsafe(handler, session_id, data)

    def shutdown(self) -> None:
        """Stop the engine thread after the command in progress."""
        self._commands.put(None)
        self._thread.join(timeout=10)

    def _submit(self, function: Callable[[], object]) -> None:
        """Run function on the engine thread, between steps, without waiting for it."""
        self._commands.put(function)

    async def _call(self, function: Callable[[], T], after_refresh_of: str | None = None) -> T:
        """Run function on the engine thread, between steps (after the refresh of that session if one is due), and
        return its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result = function()
            except Exception as exc:
                loop.call_soon_threadsafe(settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(settle, future, result, None)

        if after_refresh_of is None:
            self._commands.put(run)
        else:
            self._commands.put(lambda: self.engine.sessions.after_refresh(after_refresh_of, run))
        return await future

    def _run(self) -> None:
        stepped = False  # a forward ran since the engine last had nothing it could do
        while True:
            try:
                # nothing to do, or nothing the last step could run: wait for a command (or a pin to expire)
                idle = not (self.engine.has_work() and self.engine.last_step_ran)
                if idle and stepped:
                    # the steps' large buffers (a prompt's activations) stay with malloc once freed: hand them back
                    release_free_memory()
                    stepped = False
                if not self._drain_commands(block=idle):
                    return
                self._publish(self.engine.step())
                stepped = stepped or self.engine.last_step_ran
            except Exception:  # keep serving: a bug in one step must not kill the thread
                log.exception("engine loop error")

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if block, until the next timer: _seconds_to_next_timer); False when
        asked to stop."""
        try:
            timeout = self._seconds_to_next_timer() if block else None
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

    def _seconds_to_next_timer(self) -> float | None:
        """How long the idle engine thread may wait for a command: until a cache pin may expire or a reply refresh
        may start (Engine.seconds_to_idle_work), whichever is sooner; None: until a command comes."""
        timers = [self.engine.pool.cache_pins.seconds_to_next_expiry(), self.engine.seconds_to_idle_work()]
        return min((seconds for seconds in timers if seconds is not None), default=None)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            subscriber = self._subscribers.get(output.request_id)
            if subscriber is not None:
                subscriber.loop.call_soon_threadsafe(subscriber.outputs.put_nowait, output)
