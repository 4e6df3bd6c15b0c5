"""Where a stateless request goes: the replica that has probably cached the longest prefix of its prompt, unless it
is much busier than the least loaded one (SGLang's router's policy), or simply the next one in turn (round robin)."""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import xxhash

BLOCK_CHARS = 64  # about one KV block of 16 tokens


class Policy(enum.StrEnum):
    """How stateless requests are spread over replicas."""

    PREFIX = "prefix"  # longest cached prefix, else least loaded
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"


def prefix_blocks(text: str, block_chars: int = BLOCK_CHARS) -> list[int]:
    """Chained hashes of text's full blocks: the i-th stands for the whole prefix up to the end of block i."""
    hashes: list[int] = []
    previous = 0
    for start in range(0, len(text) - block_chars + 1, block_chars):
        previous = xxhash.xxh3_64_intdigest(text[start : start + block_chars].encode(), seed=previous)
        hashes.append(previous)
    return hashes


class PrefixIndex:
    """Per replica, the prompt prefixes routed to it lately (so probably in its prefix cache), least recently used
    dropped past a capacity: an approximation of each replica's cache, kept by the router alone."""

    def __init__(self, capacity_blocks: int = 200_000) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def matched(self, replica: str, blocks: Sequence[int]) -> int:
        """How many leading blocks of a prompt replica has seen."""
        seen = self._blocks.get(replica, OrderedDict())
        return sum(1 for _ in itertools.takewhile(seen.__contains__, blocks))

    def insert(self, replica: str, blocks: Sequence[int]) -> None:
        """Record that replica now caches a prompt's blocks."""
        seen = self._blocks.setdefault(replica, OrderedDict())
        for block in blocks:
            seen[block] = None
            seen.move_to_end(block)
        while len(seen) > self.capacity_blocks:
            seen.popitem(last=False)

    def forget(self, replica: str) -> None:
        """Drop what replica was thought to cache (it restarted or left)."""
        self._blocks.pop(replica, None)


@dataclass(frozen=True)
class Choice:
    """A replica picked for a request, and why (a metric label)."""

    replica: str
    reason: str  # prefix | least_loaded | round_robin


class Balancer:
    """Picks a replica for stateless requests by a policy; loads are requests in flight per replica."""

    def __init__(
        self, policy: Policy = Policy.PREFIX, balance_slack: int = 4, index: PrefixIndex | None = None
    ) -> None:
        self.policy = policy
        self.balance_slack = balance_slack  # a prefix is followed unless its replica has this many more in flight
        self.index = index or PrefixIndex()
        self._turn = itertools.count()
        self._routed: dict[str, int] = {}

    def pick(self, loads: Mapping[str, int], text: str | None = None) -> Choice:
        """A replica among loads' keys (at least one) for a request whose prompt is text (None: no prompt)."""
        replicas = sorted(loads)
        blocks = prefix_blocks(text) if text is not None and self.policy is Policy.PREFIX else []
        if self.policy is Policy.ROUND_ROBIN:
            choice = Choice(replicas[next(self._turn) % len(replicas)], "round_robin")
        else:
            choice = self._by_prefix(loads, replicas, blocks) or Choice(self.least_loaded(loads), "least_loaded")
        self.index.insert(choice.replica, blocks)
        self._routed[choice.replica] = self._routed.get(choice.replica, 0) + 1
        return choice

    def least_loaded(self, loads: Mapping[str, int]) -> str:
        """The replica with fewest requests in flight; ties go to the one that was given fewest so far."""
        return min(loads, key=lambda replica: (loads[replica], self._routed.get(replica, 0), replica))

    def forget(self, replica: str) -> None:
        """Forget what replica caches (it restarted or left)."""
        self.index.forget(replica)

    def _by_prefix(self, loads: Mapping[str, int], replicas: list[str], blocks: list[int]) -> Choice | None:
        if not blocks:
            return None
        matched = {replica: self.index.matched(replica, blocks) for replica in replicas}
        best = max(replicas, key=lambda replica: (matched[replica], -loads[replica]))
        if matched[best] == 0 or loads[best] > min(loads.values()) + self.balance_slack:
            return None
        return Choice(best, "prefix")
