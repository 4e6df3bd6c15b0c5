"""The cluster's routing policy, request targets and affinity table, without Ray or a model."""

from __future__ import annotations

import json

from statelm.cluster.affinity import AffinityTable
from statelm.cluster.balancer import BLOCK_CHARS, Balancer, Policy, PrefixIndex, prefix_blocks
from statelm.cluster.targets import Target, TargetKind, classify

SYSTEM = "You are a support agent for Example Corp. " * 8  # several blocks long


def chat(question: str, **extra: object) -> bytes:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return json.dumps({"model": "default", "messages": messages, **extra}).encode()


def test_prefix_blocks_chain_so_equal_hashes_mean_equal_prefixes() -> None:
    first, second = prefix_blocks("a" * BLOCK_CHARS + "b" * BLOCK_CHARS), prefix_blocks("c" * BLOCK_CHARS + "b" * 64)
    assert len(first) == 2 and first[1] != second[1]  # same second block, different prefix
    assert prefix_blocks("x" * (BLOCK_CHARS - 1)) == []  # only full blocks


def test_requests_sharing_a_system_prompt_go_where_it_is_cached() -> None:
    balancer = Balancer(Policy.PREFIX)
    loads = {"replica-0": 0, "replica-1": 0}
    first = balancer.pick(loads, classify("POST", "/v1/chat/completions", chat("Hi")).text)
    assert first.reason == "least_loaded"
    for question in ["Where is my order?", "How do I reset my password?"]:
        choice = balancer.pick(loads, classify("POST", "/v1/chat/completions", chat(question)).text)
        assert choice == type(first)(first.replica, "prefix")


def test_a_cached_prefix_yields_to_a_much_less_loaded_replica() -> None:
    balancer = Balancer(Policy.PREFIX, balance_slack=2)
    text = classify("POST", "/v1/chat/completions", chat("Hi")).text
    first = balancer.pick({"replica-0": 0, "replica-1": 0}, text).replica
    other = "replica-1" if first == "replica-0" else "replica-0"
    assert balancer.pick({first: 2, other: 0}, text).replica == first  # within the slack
    assert balancer.pick({first: 3, other: 0}, text).replica == other  # past it


def test_least_loaded_spreads_ties_and_round_robin_alternates() -> None:
    balancer = Balancer(Policy.LEAST_LOADED)
    loads = {"replica-0": 0, "replica-1": 0}
    assert {balancer.pick(loads).replica for _ in range(2)} == set(loads)
    assert balancer.pick({"replica-0": 5, "replica-1": 1}).replica == "replica-1"
    round_robin = Balancer(Policy.ROUND_ROBIN)
    text = classify("POST", "/v1/chat/completions", chat("Hi")).text
    assert [round_robin.pick(loads, text).replica for _ in range(4)] == ["replica-0", "replica-1"] * 2


def test_the_prefix_index_forgets_the_least_recently_used_and_restarted_replicas() -> None:
    index = PrefixIndex(capacity_blocks=3)
    index.insert("r", [1, 2, 3])
    index.insert("r", [4])
    assert index.matched("r", [1, 2]) == 0 and index.matched("r", [2, 3, 4]) == 3
    index.forget("r")
    assert index.matched("r", [2]) == 0


def test_targets_of_statelm_routes() -> None:
    assert classify("POST", "/v1/chat/completions", chat("Hi", session_id="s1")) == Target(TargetKind.SESSION, "s1")
    assert classify("POST", "/v1/chat/completions", chat("Hi")).kind is TargetKind.PROMPT
    assert classify("GET", "/v1/sessions/s1/history", b"") == Target(TargetKind.SESSION, "s1")
    assert classify("GET", "/v1/sessions", b"").kind is TargetKind.SESSION_LIST
    assert classify("POST", "/v1/sessions", b'{"session_id": "s2"}') == Target(TargetKind.SESSION, "s2")
    assert classify("POST", "/v1/sessions", b"{}").kind is TargetKind.ANY  # the server names it
    assert classify("POST", "/v1/snapshots/snap-1/load", b'{"session_id": "s3"}') == Target(TargetKind.SESSION, "s3")
    assert classify("GET", "/v1/snapshots", b"").kind is TargetKind.ANY  # the store is shared
    follow_up = json.dumps({"input": "And?", "previous_response_id": "resp_1"}).encode()
    assert classify("POST", "/v1/responses", follow_up) == Target(TargetKind.RESPONSE, "resp_1")
    assert classify("GET", "/v1/responses/resp_1/input_items", b"") == Target(TargetKind.RESPONSE, "resp_1")
    assert classify("DELETE", "/v1/chat/completions/chatcmpl-1", b"") == Target(TargetKind.COMPLETION, "chatcmpl-1")
    assert classify("POST", "/v1/chat/completions", b"not json").kind is TargetKind.PROMPT  # the replica says 400
    assert classify("GET", "/v1/models", b"").kind is TargetKind.ANY


def test_the_affinity_table_forgets_a_replica_whole() -> None:
    table = AffinityTable()
    table.set(TargetKind.SESSION, "a", "replica-0")
    table.set(TargetKind.RESPONSE, "resp_1", "replica-0")
    table.set(TargetKind.SESSION, "b", "replica-1")
    assert table.get(TargetKind.SESSION, "a") == "replica-0" and table.get(TargetKind.RESPONSE, "a") is None
    assert table.forget_replica("replica-0") == 2
    assert table.get(TargetKind.SESSION, "a") is None and table.get(TargetKind.SESSION, "b") == "replica-1"
