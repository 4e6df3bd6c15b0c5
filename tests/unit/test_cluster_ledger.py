"""The cluster's count of every key's sessions and stored responses (statelm.cluster.ledger), without Ray."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from statelm.cluster.ledger import KeyLedger


def test_a_key_claims_sessions_up_to_its_limit_and_a_release_makes_room() -> None:
    ledger = KeyLedger()
    assert ledger.claim("alice", "s1", 2) and ledger.claim("alice", "s2", 2)
    assert not ledger.claim("alice", "s3", 2)
    assert ledger.claim("bob", "s3", 2)  # another key's count
    assert ledger.claim("alice", "s1", 2)  # an id counted already is no new session
    ledger.release("s1")
    assert ledger.claim("alice", "s4", 2)
    assert ledger.owned("alice") == ["s2", "s4"]


def test_registered_sessions_count_whatever_the_limit() -> None:
    ledger = KeyLedger()
    ledger.register("alice", ["a", "b", "c"])
    assert not ledger.claim("alice", "d", 3)
    assert ledger.claim("alice", "d", None)


def test_the_oldest_responses_past_the_limit_are_dropped_across_sessions() -> None:
    ledger = KeyLedger()
    assert ledger.add_response("alice", "r2", "chain-b", 2.0, 2) == []
    assert ledger.add_response("alice", "r1", "chain-a", 1.0, 2) == []  # resumed later, but older
    assert ledger.add_response("bob", "r9", "chain-c", 0.5, 2) == []
    assert ledger.add_response("alice", "r3", "chain-a", 3.0, 2) == ["r1"]
    ledger.forget_responses(["r2"])
    assert ledger.add_response("alice", "r4", "chain-b", 4.0, 2) == []


def test_a_released_chain_takes_its_responses_with_it() -> None:
    ledger = KeyLedger()
    ledger.claim("alice", "chain-a", None)
    ledger.add_response("alice", "r1", "chain-a", 1.0, 1)
    ledger.release("chain-a")
    assert ledger.add_response("alice", "r2", "chain-b", 2.0, 1) == []


def test_retain_forgets_sessions_gone_from_everywhere_but_not_fresh_claims() -> None:
    ledger = KeyLedger()
    ledger.register("alice", ["kept", "lost"])
    assert ledger.retain({"kept"}, grace_s=60) == 0  # claimed just now: maybe not written yet
    assert ledger.retain({"kept"}, grace_s=0) == 1
    assert ledger.owned("alice") == ["kept"]
