"""Which replica serves what: the replicas as the router sees them, session affinity, adoption of sessions no replica
holds, and the watch that notices a replica die, restart or finish draining.

One decision at a time (a lock) for anything that may place an id on a replica, so that a session is never held
by two replicas: an id is looked up in the affinity table, else asked of every live replica, else placed on the
least loaded one, which adopts it from the shared store if it is there.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import RayActorError, RayError
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle

from statelm.cluster.affinity import AffinityTable
from statelm.cluster.balancer import Balancer, Choice
from statelm.cluster.metrics import RouterMetrics
from statelm.cluster.replica import ReplicaDrainingError
from statelm.cluster.store import SessionStore
from statelm.cluster.targets import Target, TargetKind

log = logging.getLogger(__name__)
WATCH_PERIOD_S = 1.0
PING_TIMEOUT_S = 2.0


class ReplicaState(enum.StrEnum):
    """A replica's state as the router sees it."""

    STARTING = "starting"  # deployed, not answering yet
    LIVE = "live"
    DRAINING = "draining"  # saving its sessions; requests for them wait
    DRAINED = "drained"  # saved everything and stopped its engine; gets nothing more
    LOST = "lost"  # died, unreachable or ended after a SIGTERM drain; Ray Serve restarts it as a new incarnation


class NoReplicaError(RuntimeError):
    """No replica can take the request."""


@dataclass
class Replica:
    """A replica as the router sees it: its handle, state, incarnation and requests in flight."""

    name: str
    handle: DeploymentHandle
    state: ReplicaState = ReplicaState.STARTING
    incarnation: str = ""
    actor: Any = None  # its Ray actor, pinged to notice a death at once
    pid: int | None = None
    in_flight: int = 0
    done_draining: asyncio.Event = field(default_factory=asyncio.Event)


class Placement:
    """The replicas, where each session and stored object lives, and where stateless requests go."""

    def __init__(
        self,
        handles: dict[str, DeploymentHandle],
        store: SessionStore,
        balancer: Balancer,
        metrics: RouterMetrics,
        ledger: Any,
    ) -> None:
        self.replicas = {name: Replica(name, handle) for name, handle in handles.items()}
        self.store = store
        self.ledger = ledger  # the KeyLedger actor, which counts every key's sessions over the replicas
        self.balancer = balancer
        self.metrics = metrics
        self.table = AffinityTable()
        self._lock = asyncio.Lock()
        self._watch: asyncio.Task[None] | None = None
        self._drains: dict[str, asyncio.Task[int]] = {}
        self._ledger_incarnation: str | None = None  # the ledger's start the live replicas counted in

    async def start(self) -> None:
        """Learn who the replicas are, give the store's sessions to them, and watch them from now on."""
        for replica in self.replicas.values():
            await self._refresh(replica, timeout=None, adopt=False)
        async with self._lock:
            await self._adopt_orphans()
        self._ledger_incarnation = await self.ledger.current_incarnation.remote()
        self._watch = asyncio.create_task(self._watch_replicas())

    async def stop(self) -> None:
        """Stop watching."""
        if self._watch is not None:
            self._watch.cancel()

    def live(self) -> list[Replica]:
        """The replicas that take requests."""
        return [replica for replica in self.replicas.values() if replica.state is ReplicaState.LIVE]

    async def route(self, target: Target) -> Choice:
        """The replica a request goes to."""
        if target.kind in (TargetKind.SESSION, TargetKind.RESPONSE, TargetKind.COMPLETION) and target.key:
            return Choice(await self._locate(target.kind, target.key), "session")
        loads = {replica.name: replica.in_flight for replica in self.live()}
        if not loads:
            raise NoReplicaError("no replica is serving")
        return self.balancer.pick(loads, target.text if target.kind is TargetKind.PROMPT else None)

    async def lost(self, replica: Replica, incarnation: str) -> None:
        """A replica died or restarted: what it held is orphaned, and live replicas adopt it from the store."""
        async with self._lock:
            if replica.incarnation != incarnation or replica.state is not ReplicaState.LIVE:
                return  # already handled
            replica.state = ReplicaState.LOST
            log.warning("replica %s (pid %s) is gone; its sessions go to the others", replica.name, replica.pid)
            self.metrics.replicas_lost.labels(replica.name).inc()
            self._forget(replica)
            await self._adopt_orphans()

    async def drain(self, name: str) -> int:
        """Drain a live replica: it finishes its requests and saves its sessions, which live replicas then adopt; it
        stays drained (serving nothing). KeyError if no live replica has that name."""
        replica = self.replicas.get(name)
        if replica is None or replica.state is not ReplicaState.LIVE:
            raise KeyError(name)
        return await asyncio.shield(self._start_drain(replica, ReplicaState.DRAINED))

    def draining(self, replica: Replica, incarnation: str) -> None:
        """A replica drains on its own (SIGTERM): treat it as draining until it is done; it then ends, and Ray Serve
        starts a new incarnation."""
        if replica.incarnation == incarnation and replica.state is ReplicaState.LIVE:
            log.info("replica %s (pid %s) drains (SIGTERM); its sessions go to the others", replica.name, replica.pid)
            self._start_drain(replica, ReplicaState.LOST)

    async def drain_finished(self, name: str) -> None:
        """Return once a drain under way of that replica, if any, is over."""
        task = self._drains.get(name)
        if task is not None:
            await asyncio.shield(task)

    def add(self, handles: dict[str, DeploymentHandle]) -> None:
        """New replicas (a scale-up); each is live once it answers (at the next watch)."""
        self.replicas.update((name, Replica(name, handle)) for name, handle in handles.items())

    def remove(self, name: str) -> None:
        """Forget a drained replica (a scale-down, before its application is deleted)."""
        replica = self.replicas.pop(name)
        self._forget(replica)

    def _start_drain(self, replica: Replica, after: ReplicaState) -> asyncio.Task[int]:
        """Send the replica nothing new from now on, hold requests for its sessions, and drain it; after that it is in
        state after and the live replicas have adopted its sessions."""
        replica.state = ReplicaState.DRAINING
        replica.done_draining.clear()
        task = asyncio.create_task(self._drain(replica, after))
        self._drains[replica.name] = task
        return task

    async def _drain(self, replica: Replica, after: ReplicaState) -> int:
        saved = 0
        try:
            saved = await replica.handle.drain.remote(replica.incarnation)
        except RayError as exc:  # it died meanwhile: what it saved, and its journals, are in the store
            log.warning("replica %s ended while draining: %s", replica.name, exc)
        finally:
            try:
                async with self._lock:
                    replica.state = after
                    self._forget(replica)
                    await self._adopt_orphans()
            finally:  # requests held for its sessions go on, even if the others could not be asked to adopt them
                replica.done_draining.set()
                self._drains.pop(replica.name, None)
        log.info("drained replica %s: %d sessions saved and adopted by the others", replica.name, saved)
        return saved

    async def _locate(self, kind: TargetKind, key: str) -> str:
        while True:
            replica = self.replicas.get(self.table.get(kind, key) or "")
            if replica is not None and replica.state is ReplicaState.LIVE:
                return replica.name
            draining = [r for r in self.replicas.values() if r.state is ReplicaState.DRAINING]
            if draining:  # it may hold the id, unknown to the table: decide once its sessions are in the store
                await asyncio.wait([asyncio.create_task(r.done_draining.wait()) for r in draining])
                continue
            async with self._lock:
                found = await self._discover(kind, key)
            if found is not None:
                return found

    async def _discover(self, kind: TargetKind, key: str) -> str | None:
        """Where an id the table does not place is: the live replica holding it, else the least loaded one (which
        adopts a session the store holds, or is where a new session with that id will be made); None to look again."""
        known = self.replicas.get(self.table.get(kind, key) or "")
        if known is not None and known.state is ReplicaState.LIVE:
            return known.name  # placed while this waited for the lock
        live = self.live()
        if not live:
            raise NoReplicaError("no replica is serving")
        answers = await asyncio.gather(*(r.handle.holds.remote(kind, key, r.incarnation) for r in live))
        holders = [replica for replica, holds in zip(live, answers, strict=True) if holds]
        loads = {replica.name: replica.in_flight for replica in live}
        chosen = holders[0] if holders else self.replicas[self.balancer.pick(loads).replica]
        if kind is not TargetKind.SESSION and not holders:
            return chosen.name  # nobody holds it: any replica answers 404, and the table keeps no entry for it
        if not holders and await asyncio.to_thread(self.store.has_session, key):
            try:
                await chosen.handle.adopt.remote([key], chosen.incarnation)
            except ReplicaDrainingError:  # it took SIGTERM meanwhile: look again, without it
                self.draining(chosen, chosen.incarnation)
                return None
        self.table.set(kind, key, chosen.name)
        return chosen.name

    async def _adopt_orphans(self) -> None:
        """Give the sessions the store holds and no live replica holds to the live replicas, fewest sessions first;
        the ledger then stops counting sessions that are neither (lost with a replica that never saved them).

        The store is listed before replicas are asked, so that a session made meanwhile is held, not orphaned.
        """
        live = self.live()
        if not live:
            return
        stored = await asyncio.to_thread(self.store.session_ids)
        held = await asyncio.gather(*(replica.handle.held.remote(replica.incarnation) for replica in live))
        gone = await self.ledger.retain.remote(stored.union(*map(set, held)))
        if gone:
            log.info("%d sessions lost with a replica are no longer counted toward their keys' limits", gone)
        counts = {replica.name: len(ids) for replica, ids in zip(live, held, strict=True)}
        assigned: dict[str, list[str]] = defaultdict(list)
        for session_id in sorted(stored - set().union(*map(set, held))):
            name = min(counts, key=lambda replica: (counts[replica], replica))
            counts[name] += 1
            assigned[name].append(session_id)
        for name, session_ids in assigned.items():
            replica = self.replicas[name]
            try:
                adopted = await replica.handle.adopt.remote(session_ids, replica.incarnation)
            except ReplicaDrainingError:  # it took SIGTERM meanwhile: the others adopt these once it is done
                self.draining(replica, replica.incarnation)
                continue
            for session_id in adopted:
                self.table.set(TargetKind.SESSION, session_id, name)
        if assigned:
            log.info("replicas adopted %d sessions from the store", sum(map(len, assigned.values())))

    def _forget(self, replica: Replica) -> None:
        self.table.forget_replica(replica.name)
        self.balancer.forget(replica.name)

    async def _watch_replicas(self) -> None:
        """Notice a replica's death at once (its actor stops answering) and its restart (a new incarnation), and a
        restart of the ledger."""
        while True:
            await asyncio.sleep(WATCH_PERIOD_S)
            for replica in list(self.replicas.values()):
                if replica.state in (ReplicaState.STARTING, ReplicaState.LIVE, ReplicaState.LOST):
                    try:
                        await self._refresh(replica, PING_TIMEOUT_S)
                    except (RayError, RayServeException) as exc:  # e.g. its application deleted: look again
                        log.warning("could not look at replica %s: %s", replica.name, exc)
            await self._check_ledger()

    async def _check_ledger(self) -> None:
        """After Ray restarted the ledger (empty), have every live replica count what it holds in it again."""
        try:
            incarnation = await asyncio.wait_for(self.ledger.current_incarnation.remote(), PING_TIMEOUT_S)
        except (TimeoutError, RayError):
            return
        if incarnation == self._ledger_incarnation:
            return
        log.warning("the key ledger restarted; the replicas count their sessions and stored responses in it again")
        live = self.live()
        answers = await asyncio.gather(*(r.handle.recount.remote(r.incarnation) for r in live), return_exceptions=True)
        if not any(isinstance(answer, BaseException) for answer in answers):
            self._ledger_incarnation = incarnation  # else again at the next look

    async def _refresh(self, replica: Replica, timeout: float | None, adopt: bool = True) -> None:
        """Ping a live replica's actor (and notice a drain it started); ask a starting or lost one who it is now: once
        it answers it is live (and, with adopt, takes its share of the sessions nobody holds)."""
        if replica.state is ReplicaState.LIVE and replica.actor is not None:
            incarnation = replica.incarnation
            try:
                await asyncio.wait_for(replica.actor.__ray_ready__.remote(), timeout)
                info = await asyncio.wait_for(replica.handle.info.remote(), timeout)
            except RayActorError:
                await self.lost(replica, incarnation)
            except TimeoutError:
                pass  # busy, not gone
            else:
                if info["draining"] and info["incarnation"] == incarnation:
                    self.draining(replica, incarnation)
            return
        try:
            info = await asyncio.wait_for(replica.handle.info.remote(), timeout)
        except (TimeoutError, RayActorError):
            return
        async with self._lock:
            if info["incarnation"] == replica.incarnation:
                return  # live already, or the incarnation declared lost (whose sessions others hold now)
            replica.incarnation, replica.actor, replica.pid = info["incarnation"], info["actor"], info["pid"]
            replica.state = ReplicaState.LIVE
            log.info("replica %s is live (pid %s)", replica.name, replica.pid)
            if adopt:
                await self._adopt_orphans()
