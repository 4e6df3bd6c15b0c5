"""Changing the number of replicas while the cluster serves: `POST /v1/cluster/scale`.

A scale-up deploys new replicas (named with numbers never used before in this cluster) and returns at once; each is
`starting` until it answers, then live (holding nothing until it is given sessions). A scale-down drains the
replicas with the highest numbers, one after another: each finishes its requests and saves its sessions to the
store, the others adopt them, and its Ray Serve application is deleted. Replicas already drained by the drain route
are deleted first and do not count. On a local Ray instance a scale-up that its CPUs (or GPUs) cannot place is
refused (NoRoomError) rather than left `starting` for ever; on a cluster joined with --ray-address, Ray (and its
autoscaler) decides, and a replica it cannot place stays `starting`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ray.serve.handle import DeploymentHandle

from statelm.cluster.placement import Placement, ReplicaState

log = logging.getLogger(__name__)


class NoRoomError(RuntimeError):
    """The Ray instance cannot place the replicas a scale-up asks for."""


def replica_index(name: str) -> int:
    """The number in a replica's name (replica-3: 3)."""
    return int(name.rsplit("-", 1)[1])


class Scaler:
    """Scales the replicas one request at a time."""

    def __init__(
        self,
        placement: Placement,
        deploy: Callable[[list[str]], dict[str, DeploymentHandle]],
        delete: Callable[[str, bool], None],
        name_of: Callable[[int], str],
        room: Callable[[], int] | None = None,
    ) -> None:
        self.placement = placement
        self.deploy = deploy  # starts replicas by name without waiting for them (blocks briefly)
        self.delete = delete  # has a replica's application deleted, waiting for it to be gone or not (blocks)
        self.name_of = name_of
        self.room = room  # how many more replicas Ray can place now; None: unknown (a cluster that may autoscale)
        self._next = max(map(replica_index, placement.replicas), default=-1) + 1  # names are never used twice
        self._lock = asyncio.Lock()

    async def scale(self, count: int) -> tuple[list[str], list[str]]:
        """Have count replicas that are not drained; the names added and the names removed."""
        async with self._lock:
            removed = [name for name, r in self.placement.replicas.items() if r.state is ReplicaState.DRAINED]
            names = sorted(set(self.placement.replicas) - set(removed), key=replica_index)
            wanted = count - len(names)
            if wanted > 0 and self.room is not None and (room := self.room() + len(removed)) < wanted:
                raise NoRoomError(  # a drained replica still holds its resources until it is removed below
                    f"Ray has room for {room} more replicas ({len(names)} now), not {wanted}; start the cluster "
                    "with --ray-address to use more machines, or with a smaller --replica-cpus"
                )
            for name in removed:
                await self._remove(name)
            added: list[str] = []
            if wanted > 0:
                added = [self.name_of(self._next + offset) for offset in range(wanted)]
                self._next += len(added)
                self.placement.add(await asyncio.to_thread(self.deploy, added))
                log.info("scaling up: started %s", ", ".join(added))
            for name in reversed(names[count:]):
                if self.placement.replicas[name].state is ReplicaState.LIVE:
                    await self.placement.drain(name)
                await self.placement.drain_finished(name)  # one it started itself (SIGTERM) included
                await self._remove(name)
                removed.append(name)
            if removed:
                log.info("scaled down: removed %s", ", ".join(removed))
            return added, removed

    async def _remove(self, name: str) -> None:
        placed = self.placement.replicas[name].state is not ReplicaState.STARTING  # its resources are freed by then
        self.placement.remove(name)
        await asyncio.to_thread(self.delete, name, placed)
