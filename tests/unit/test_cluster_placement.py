"""Where the router places ids (statelm.cluster.placement), over stand-in replicas, without Ray or a model."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray")

from statelm.cluster.balancer import Balancer, Policy
from statelm.cluster.ledger import KeyLedger
from statelm.cluster.metrics import RouterMetrics
from statelm.cluster.placement import Placement, ReplicaState
from statelm.cluster.scaling import NoRoomError, Scaler
from statelm.cluster.targets import Target, TargetKind
from tests.ray_fakes import Remote


class StandIn:
    """A replica that holds some ids of every kind and adopts what it is given."""

    def __init__(self, held: set[str]) -> None:
        self.holding = held
        self.adopted: list[str] = []
        self.recounts = 0

    def holds(self, kind: TargetKind, key: str, incarnation: str) -> bool:
        return key in self.holding

    def adopt(self, session_ids: list[str], incarnation: str) -> list[str]:
        self.adopted.extend(session_ids)
        return session_ids

    def recount(self, incarnation: str) -> None:
        self.recounts += 1

    def held(self, incarnation: str) -> list[str]:
        return sorted(self.held_sessions())

    def held_sessions(self) -> set[str]:
        return self.holding | set(self.adopted)


class Saving(StandIn):
    """A replica whose drain saves what it holds to the store once released."""

    def __init__(self, held: set[str], store: set[str]) -> None:
        super().__init__(held)
        self.store = store
        self.released = asyncio.Event()

    async def drain(self, incarnation: str) -> int:
        await self.released.wait()
        saved = self.held_sessions()
        self.store |= saved
        self.holding, self.adopted = set(), []
        return len(saved)


class Store:
    def __init__(self, ids: set[str]) -> None:
        self.ids = ids

    def session_ids(self) -> set[str]:
        return self.ids

    def has_session(self, session_id: str) -> bool:
        return session_id in self.ids


def placement(replicas: dict[str, StandIn], stored: set[str]) -> Placement:
    handles = {name: Remote(replica) for name, replica in replicas.items()}
    placed = Placement(handles, Store(stored), Balancer(Policy.LEAST_LOADED), RouterMetrics(), Remote(KeyLedger()))
    for replica in placed.replicas.values():
        replica.state = ReplicaState.LIVE
    return placed


def test_stored_objects_are_found_where_they_are_and_unknown_ids_leave_no_entry() -> None:
    placed = placement({"replica-0": StandIn(set()), "replica-1": StandIn({"chatcmpl-1", "resp-1"})}, set())
    for kind, key in [(TargetKind.COMPLETION, "chatcmpl-1"), (TargetKind.RESPONSE, "resp-1")]:
        assert asyncio.run(placed.route(Target(kind, key))).replica == "replica-1"
        assert placed.table.get(kind, key) == "replica-1"
    asyncio.run(placed.route(Target(TargetKind.COMPLETION, "chatcmpl-unknown")))
    assert placed.table.get(TargetKind.COMPLETION, "chatcmpl-unknown") is None


def test_a_session_nobody_holds_is_adopted_from_the_store_and_placed() -> None:
    replicas = {"replica-0": StandIn(set()), "replica-1": StandIn(set())}
    placed = placement(replicas, {"sess-stored"})
    name = asyncio.run(placed.route(Target(TargetKind.SESSION, "sess-stored"))).replica
    assert replicas[name].adopted == ["sess-stored"] and placed.table.get(TargetKind.SESSION, "sess-stored") == name
    new = asyncio.run(placed.route(Target(TargetKind.SESSION, "sess-new"))).replica  # where POST /v1/sessions makes it
    assert placed.table.get(TargetKind.SESSION, "sess-new") == new


def test_after_the_ledger_restarts_every_live_replica_counts_into_it_again() -> None:
    replicas = {"replica-0": StandIn(set()), "replica-1": StandIn(set())}
    placed = placement(replicas, set())
    asyncio.run(placed._check_ledger())  # the router learns which start of the ledger the replicas count in
    before = [replica.recounts for replica in replicas.values()]
    asyncio.run(placed._check_ledger())
    assert [replica.recounts for replica in replicas.values()] == before
    placed.ledger.target = KeyLedger()  # what Ray's restart gives: an empty ledger, a new incarnation
    asyncio.run(placed._check_ledger())
    asyncio.run(placed._check_ledger())
    assert [replica.recounts for replica in replicas.values()] == [count + 1 for count in before]


def test_a_replica_draining_on_its_own_holds_its_sessions_turns_until_the_others_adopted_them() -> None:
    async def scenario() -> None:
        store: set[str] = set()
        saving, other = Saving({"sess-a"}, store), StandIn(set())
        placed = placement({"replica-0": saving, "replica-1": other}, store)
        placed.table.set(TargetKind.SESSION, "sess-a", "replica-0")
        placed.draining(placed.replicas["replica-0"], placed.replicas["replica-0"].incarnation)  # it took SIGTERM
        assert placed.replicas["replica-0"].state is ReplicaState.DRAINING
        known, unknown = (
            asyncio.create_task(placed.route(Target(TargetKind.SESSION, k))) for k in ("sess-a", "sess-x")
        )
        stateless = await placed.route(Target(TargetKind.PROMPT, text="hello"))
        assert stateless.replica == "replica-1"
        await asyncio.sleep(0.05)
        assert not known.done() and not unknown.done()  # it may still hold them: decided once they are saved
        saving.released.set()
        assert (await known).replica == (await unknown).replica == "replica-1"
        assert other.adopted == ["sess-a"]
        assert placed.replicas["replica-0"].state is ReplicaState.LOST  # it ends; Ray Serve starts it again

    asyncio.run(scenario())


def test_scaling_down_drains_the_highest_replicas_and_scaling_up_starts_new_ones() -> None:
    async def scenario() -> None:
        store: set[str] = set()
        replicas = {"replica-0": Saving(set(), store), "replica-1": Saving({"sess-b"}, store)}
        for replica in replicas.values():
            replica.released.set()
        placed = placement(replicas, store)
        deployed: list[str] = []
        deleted: list[str] = []

        def deploy(names: list[str]) -> dict[str, Remote]:
            deployed.extend(names)
            return {name: Remote(StandIn(set())) for name in names}

        room = 0
        scaler = Scaler(placed, deploy, lambda name, wait: deleted.append(name), lambda i: f"replica-{i}", lambda: room)
        with pytest.raises(NoRoomError):
            await scaler.scale(3)
        assert list(placed.replicas) == ["replica-0", "replica-1"] and not deployed
        assert await scaler.scale(1) == ([], ["replica-1"])
        assert deleted == ["replica-1"] and list(placed.replicas) == ["replica-0"]
        assert replicas["replica-0"].adopted == ["sess-b"]  # saved by the drain, adopted by the one left
        room = 3
        assert await scaler.scale(3) == (["replica-2", "replica-3"], [])  # a name is never given twice
        assert deployed == ["replica-2", "replica-3"]
        assert placed.replicas["replica-3"].state is ReplicaState.STARTING  # live once it answers
        await placed.drain("replica-0")
        room = 0
        with pytest.raises(NoRoomError):
            await scaler.scale(4)  # the drained replica's room and no more
        assert "replica-0" in placed.replicas  # a refused scale changes nothing
        assert await scaler.scale(3) == (["replica-4"], ["replica-0"])  # a drained replica goes and does not count

    asyncio.run(scenario())
