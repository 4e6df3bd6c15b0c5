"""API keys: accepted keys and their principals, the key file's reload, request headers, bind warnings."""

from __future__ import annotations

import os
from pathlib import Path

from statelm.server.auth import KeyRing, key_digest, owner_of, presented_key
from statelm.server.launch import is_loopback


def test_user_and_admin_keys_act_as_their_own_principals() -> None:
    ring = KeyRing(["user-key"], ["admin-key"])
    user, admin = ring.principal("user-key"), ring.principal("admin-key")
    assert user is not None and not user.admin
    assert admin is not None and admin.admin
    assert user.owner == owner_of(key_digest("user-key")) != admin.owner
    assert "user-key" not in user.owner and len(user.owner) == len("sha256:") + 64
    assert ring.principal("user-key ") is None and ring.principal("") is None and ring.principal("nope") is None


def test_the_key_file_is_read_again_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# team keys\nfirst-key\n\n  second-key  \n")
    ring = KeyRing([], [], path)
    assert ring.principal("first-key") is not None and ring.principal("second-key") is not None
    assert ring.principal("# team keys") is None
    replacement = tmp_path / "keys.new"
    replacement.write_text("third-key\n")
    os.replace(replacement, path)
    assert ring.principal("first-key") is None and ring.principal("third-key") is not None
    path.unlink()
    assert ring.principal("third-key") is None  # an unreadable file lets nobody in through it
    path.write_text("third-key\n")
    assert ring.principal("third-key") is not None


def test_keys_are_taken_from_bearer_or_x_api_key() -> None:
    assert presented_key({b"authorization": b"Bearer abc"}) == "abc"
    assert presented_key({b"authorization": b"bearer  abc "}) == "abc"
    assert presented_key({b"x-api-key": b"xyz"}) == "xyz"
    assert presented_key({b"authorization": b"Basic dXNlcg==", b"x-api-key": b"xyz"}) == "xyz"
    assert presented_key({b"authorization": b"Bearer "}) is None
    assert presented_key({}) is None


def test_only_loopback_addresses_count_as_local() -> None:
    for host in ("127.0.0.1", "127.1.2.3", "::1", "localhost"):
        assert is_loopback(host)
    for host in ("0.0.0.0", "::", "192.168.1.4", "example.com", ""):
        assert not is_loopback(host)
