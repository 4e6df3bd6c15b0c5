"""Which replica holds each session, response chain or stored completion the router has routed: a cache of what
the replicas themselves hold (the truth), so it needs no durability and is rebuilt by asking them."""

from __future__ import annotations

from statelm.cluster.targets import TargetKind


class AffinityTable:
    """(kind, id) → replica name, for the ids requests named."""

    def __init__(self) -> None:
        self._replicas: dict[tuple[TargetKind, str], str] = {}

    def get(self, kind: TargetKind, key: str) -> str | None:
        """The replica last known to hold it, if any."""
        return self._replicas.get((kind, key))

    def set(self, kind: TargetKind, key: str, replica: str) -> None:
        """Record that replica holds it (or is where it will be made)."""
        self._replicas[kind, key] = replica

    def forget_replica(self, replica: str) -> int:
        """Drop every entry of a replica that restarted, died or was drained; how many there were."""
        gone = [entry for entry, holder in self._replicas.items() if holder == replica]
        for entry in gone:
            del self._replicas[entry]
        return len(gone)
