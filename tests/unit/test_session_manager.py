"""The sessions layer against a fake engine: turns commit or change nothing, KV moves only through the EngineClient."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
import torch

from statelm.config import SessionDurability
from statelm.sessions.errors import SessionBusyError
from statelm.sessions.manager import SessionManager
from statelm.sessions.session import SessionSettings, SessionState
from statelm.sessions.state_store import StateStore
from statelm.sessions.storage import StorageError
from tests.unit.fake_engine import FINGERPRINT, FakeEngine, token_kv
from tests.unit.faulty_state_store import LOG_WRITES, Fault, FaultyStore

USER = {"role": "user", "content": "Hi"}
REPLY = {"role": "assistant", "content": "Hello"}
T = TypeVar("T")


def with_manager(
    store: StateStore, engine: FakeEngine, work: Callable[[SessionManager], Awaitable[T]], durability: str = "turn"
) -> T:
    """Run work on a started manager over engine, and close the manager after it."""

    async def run() -> T:
        manager = SessionManager(engine, "tiny", FINGERPRINT, store, SessionDurability(durability))
        await manager.start()
        try:
            return await work(manager)
        finally:
            await manager.close()

    return asyncio.run(run())


async def settle(manager: SessionManager) -> None:
    """Let the background writes (spilled KV to the store) finish."""
    await asyncio.gather(*manager._writes)


def test_a_completed_turn_commits_its_messages_and_kv_a_dropped_one_changes_nothing(state_store: StateStore) -> None:
    engine = FakeEngine(reply=[7, 8])

    async def work(manager: SessionManager) -> list[tuple[str, str]]:
        session = await manager.create("s", SessionSettings())
        assert manager.begin_turn("s") is session
        with pytest.raises(SessionBusyError):
            manager.begin_turn("s")
        engine.parked["turn-1"] = token_kv([1, 2, 7, 8])
        manager.end_turn(session, "turn-1", [USER, REPLY])
        await manager.settled(session)
        assert session.transcript == [USER, REPLY] and not session.busy
        manager.begin_turn("s")
        engine.parked["turn-2"] = token_kv([1, 2, 7, 8, 3, 9])
        manager.end_turn(session, "turn-2", None)
        await manager.settled(session)
        assert session.transcript == [USER, REPLY] and not session.busy
        (view,) = await manager.view([session])
        assert view.num_tokens == 4 and view.state is SessionState.RESIDENT
        return engine.committed

    assert with_manager(state_store, engine, work) == [("turn-1", "s")]
    assert engine.discarded == ["turn-2"] and engine.resident["s"].tokens == [1, 2, 7, 8]


def test_a_spilled_session_is_written_to_the_store_and_restored_by_its_next_turn(state_store: StateStore) -> None:
    engine = FakeEngine(reply=[7])

    async def work(manager: SessionManager) -> None:
        session = await manager.create("s", SessionSettings())
        engine.resident["s"] = token_kv([1, 2, 3])
        engine.spill("s")
        await settle(manager)
        assert session.on_disk and session.spilled_kv is None and session.stored_tokens == 3
        (view,) = await manager.view([session])
        assert view.num_tokens == 3 and view.state is SessionState.SPILLED
        restore = await manager.kv_to_restore(session)
        assert restore is not None and restore.tokens == [1, 2, 3]
        assert torch.equal(restore.keys[0], token_kv([1, 2, 3]).keys[0])
        engine.resident["s"] = restore
        assert await manager.kv_to_restore(session) is None  # resident: nothing to restore

    with_manager(state_store, engine, work)


def test_fork_shares_resident_kv_through_the_engine_and_copies_spilled_kv(state_store: StateStore) -> None:
    engine = FakeEngine(reply=[7])

    async def work(manager: SessionManager) -> None:
        parent = await manager.create("parent", SessionSettings())
        parent.transcript.extend([USER, REPLY])
        engine.resident["parent"] = token_kv([1, 2, 3])
        child = await manager.fork("parent", "child")
        assert child.transcript == parent.transcript
        assert engine.resident["child"] is engine.resident["parent"]
        engine.spill("parent")
        await settle(manager)
        grandchild = await manager.fork("parent", "grandchild")
        assert "grandchild" not in engine.resident
        assert grandchild.spilled_kv is not None or grandchild.on_disk
        await settle(manager)
        restore = await manager.kv_to_restore(grandchild)
        assert restore is not None and restore.tokens == [1, 2, 3]

    with_manager(state_store, engine, work)


def test_delete_releases_the_engines_kv(state_store: StateStore) -> None:
    engine = FakeEngine(reply=[7])

    async def work(manager: SessionManager) -> None:
        await manager.create("s", SessionSettings())
        engine.resident["s"] = token_kv([1, 2])
        await manager.delete("s")
        assert "s" not in engine.resident and "s" not in manager.sessions

    with_manager(state_store, engine, work)


def test_sessions_written_and_deleted_leave_no_per_session_lock_behind(state_store: StateStore) -> None:
    engine = FakeEngine(reply=[7])

    async def work(manager: SessionManager) -> None:
        for number in range(20):
            session_id = f"s{number}"
            await manager.create(session_id, SessionSettings())
            engine.resident[session_id] = token_kv([1, 2, number])
            engine.spill(session_id)
            await settle(manager)
            assert manager.sessions[session_id].on_disk
            await manager.delete(session_id)
        assert not manager.sessions and len(manager._disk_locks) == 0

    with_manager(state_store, engine, work)


def test_a_snapshot_loads_into_the_pool_or_stays_spilled_when_it_cannot_fit(state_store: StateStore) -> None:
    engine = FakeEngine(reply=[7], capacity=4)

    async def work(manager: SessionManager) -> None:
        session = await manager.create("s", SessionSettings())
        session.transcript.extend([USER, REPLY])
        engine.resident["s"] = token_kv([1, 2, 3])
        manifest = await manager.snapshot("s", {"title": "t"})
        loaded = await manager.load_snapshot(manifest["id"], "copy", overwrite=False)
        assert loaded.transcript == [USER, REPLY] and engine.resident["copy"].tokens == [1, 2, 3]
        engine.resident["s"] = token_kv(list(range(10)))  # more than the pool holds
        manifest = await manager.snapshot("s", {})
        too_big = await manager.load_snapshot(manifest["id"], "big", overwrite=False)
        assert "big" not in engine.resident and too_big.stored_tokens == 10
        await manager.create("empty", SessionSettings())
        manifest = await manager.snapshot("empty", {})
        assert manifest["num_tokens"] == 0

    with_manager(state_store, engine, work)


def test_sessions_stop_taking_spilled_kv_when_the_manager_closes(state_store: StateStore) -> None:
    engine = FakeEngine(reply=[7])
    with_manager(state_store, engine, lambda manager: asyncio.sleep(0), durability="off")
    assert engine._spill is None


def test_a_turn_whose_record_cannot_be_written_is_taken_back_and_its_kv_stays_the_sessions(
    state_store: StateStore,
) -> None:
    engine, store = FakeEngine(reply=[7, 8]), FaultyStore(state_store)

    async def work(manager: SessionManager) -> None:
        session = await manager.create("s", SessionSettings())
        manager.begin_turn("s")
        engine.parked["turn-1"] = token_kv([1, 2, 7, 8])
        store.inject(Fault(LOG_WRITES))
        manager.end_turn(session, "turn-1", [USER, REPLY])
        with pytest.raises(StorageError):
            await manager.settled(session)
        assert session.transcript == [] and not session.busy

    with_manager(store, engine, work)
    # the engine was told to commit at once; the next turn keeps of that KV what the transcript still matches
    assert engine.committed == [("turn-1", "s")] and engine.resident["s"].tokens == [1, 2, 7, 8]


def test_a_deletion_that_cannot_be_recorded_keeps_the_session_and_its_kv(state_store: StateStore) -> None:
    engine, store = FakeEngine(reply=[7]), FaultyStore(state_store)

    async def work(manager: SessionManager) -> None:
        await manager.create("s", SessionSettings())
        engine.resident["s"] = token_kv([1, 2])
        store.inject(Fault(LOG_WRITES))
        with pytest.raises(StorageError, match="deletion of session 's'"):
            await manager.delete("s")
        assert "s" in manager.sessions and "s" in engine.resident and not manager.sessions["s"].busy
        store.clear()
        await manager.delete("s")
        assert "s" not in manager.sessions and "s" not in engine.resident

    with_manager(store, engine, work)
