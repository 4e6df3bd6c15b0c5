"""Where the router places ids (statelm.cluster.placement), over stand-in replicas, without Ray or a model."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray")

from statelm.cluster.balancer import Balancer, Policy
from statelm.cluster.ledger import KeyLedger
from statelm.cluster.metrics import RouterMetrics
from statelm.cluster.placement import Placement, ReplicaState
from statelm.cluster.targets import Target, TargetKind
from tests.ray_fakes import Remote


class StandIn:
    """A replica that holds some ids of every kind and adopts what it is given."""

    def __init__(self, held: set[str]) -> None:
        self.held = held
        self.adopted: list[str] = []
        self.recounts = 0

    def holds(self, kind: TargetKind, key: str, incarnation: str) -> bool:
        return key in self.held

    def adopt(self, session_ids: list[str], incarnation: str) -> list[str]:
        self.adopted.extend(session_ids)
        return session_ids

    def recount(self, incarnation: str) -> None:
        self.recounts += 1


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
