"""The session journal: its file format (round trip, torn tails, damage), ordered writes, compaction, recovery."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from statelm.engine.session_kv import SessionKVData
from statelm.models.loader import ModelFingerprint
from statelm.sessions.directory_store import DirectoryStore
from statelm.sessions.journal import HEADER, JournalCorruptError, decode_journal, encode_record
from statelm.sessions.journal_records import (
    annotation_record,
    delete_record,
    replay,
    rollback_record,
    session_record,
    turn_record,
)
from statelm.sessions.journal_store import SessionJournal
from statelm.sessions.recovery import recover_sessions
from statelm.sessions.session import Session, SessionKind, SessionSettings
from statelm.sessions.snapshot_format import KV, MANIFEST, TOKENS, TRANSCRIPT, SnapshotContent, write_snapshot
from statelm.sessions.state_store import Area, StateStore

FINGERPRINT = ModelFingerprint({"config": "c", "weights": "w", "dtype": "float32", "tokenizer": "t"})
USER = {"role": "user", "content": 'héllo \x01 "quoted" SLJ'}
REPLY = {"role": "assistant", "content": "hi"}


def new_session(session_id: str = "s", lsn: int = 1) -> Session:
    session = Session(session_id, SessionSettings(max_tokens=99, system="Be brief."), owner="owner-hash")
    session.transcript = [{"role": "system", "content": "Be brief."}]
    session.lsn = lsn
    return session


def history_records(session_id: str = "s") -> list[dict]:
    """A session created, two turns, a rollback to the first turn, one more turn: lsn 1 to 5."""
    session = new_session(session_id)
    records = [session_record(session)]
    for lsn, messages in ((2, [USER, REPLY]), (3, [USER, {"role": "assistant", "content": "again"}])):
        session.lsn = lsn
        records.append(turn_record(session, messages))
    session.lsn = 4
    records.append(rollback_record(session, 3))
    session.lsn = 5
    records.append(turn_record(session, [{"role": "user", "content": "last"}, REPLY]))
    return records


def write_journal(store: StateStore, session_id: str, records: list[dict]) -> list[int]:
    """The records appended one by one to the session's journal; the byte offset where each starts."""
    store.prepare(Area.JOURNAL, exclusive=False)
    offsets = []
    for record in records:
        offsets.append(store.log_size(session_id) if store.log_exists(session_id) else 0)
        store.append_log(session_id, encode_record(record))
    return offsets


def read_journal(store: StateStore, session_id: str) -> list[dict]:
    """The records of the session's journal."""
    return decode_journal(store.read_log(session_id)).records


def test_records_round_trip_and_replay_to_the_session(state_store: StateStore) -> None:
    records = history_records()
    write_journal(state_store, "s", records)
    contents = decode_journal(state_store.read_log("s"))
    assert (
        contents.records == records and contents.torn_bytes == 0 and contents.valid_bytes == state_store.log_size("s")
    )
    session = replay("s", None, contents.records)
    assert session is not None and session.lsn == 5
    assert session.transcript == [{"role": "system", "content": "Be brief."}, USER, REPLY, {"role": "user",
                                  "content": "last"}, REPLY]  # fmt: skip
    assert session.owner == "owner-hash" and session.settings.max_tokens == 99


def test_a_journal_cut_anywhere_in_its_last_record_recovers_to_the_record_before(state_store: StateStore) -> None:
    records = history_records()
    last_start = write_journal(state_store, "whole", records)[-1]
    data = state_store.read_log("whole")
    for cut in range(last_start, len(data)):
        state_store.replace_log(f"cut-{cut}", data[:cut])
        contents = decode_journal(state_store.read_log(f"cut-{cut}"))
        assert contents.records == records[:-1], cut
        assert contents.valid_bytes == last_start and contents.torn_bytes == cut - last_start


@pytest.mark.parametrize("where", ["payload", "checksum", "length", "magic"])
def test_a_damaged_last_record_is_torn_but_a_damaged_earlier_one_is_corruption(
    state_store: StateStore, where: str
) -> None:
    records = history_records()
    offsets = write_journal(state_store, "s", records)
    position = {"magic": 0, "length": 4, "checksum": 8, "payload": HEADER.size + 3}[where]
    for index, start in ((len(records) - 1, offsets[-1]), (1, offsets[1])):
        damaged = bytearray(state_store.read_log("s"))
        damaged[start + position] ^= 0x5A
        state_store.replace_log(f"damaged-{index}", bytes(damaged))
        if index == len(records) - 1:
            assert read_journal(state_store, f"damaged-{index}") == records[:-1]
        else:
            with pytest.raises(JournalCorruptError, match=f"byte {start}"):
                read_journal(state_store, f"damaged-{index}")


def test_replay_deletes_and_refuses_a_change_with_no_session_before_it() -> None:
    records = history_records()
    assert replay("s", new_session(lsn=5), [*records, delete_record(6)]) is None
    recreated = replay("s", None, [*records, delete_record(6), {**records[0], "lsn": 7}])
    assert recreated is not None and recreated.transcript == [{"role": "system", "content": "Be brief."}]
    with pytest.raises(JournalCorruptError):
        replay("s", None, records[1:])


def save(store: StateStore, session: Session, tokens: int = 4) -> None:
    """A session's saved bundle as a spill or a graceful stop writes it."""
    kv = SessionKVData(list(range(tokens)), [torch.zeros(tokens, 1, 2)], [torch.zeros(tokens, 1, 2)])
    manifest = {"model": {"name": "m", "fingerprint": FINGERPRINT.parts}, "lsn": session.lsn,
                **session.manifest_fields()}  # fmt: skip
    write_snapshot(store, Area.SESSIONS, session.id, manifest, SnapshotContent(session.transcript, kv))


def edit_manifest(store: StateStore, session_id: str, old: str, new: str) -> None:
    """Replace text in a saved session's manifest."""
    manifest = store.read_file(Area.SESSIONS, session_id, MANIFEST)
    store.replace_file(Area.SESSIONS, session_id, MANIFEST, manifest.replace(old.encode(), new.encode()))


def test_recovery_from_bundle_plus_journal_journal_alone_and_deletions(
    state_store: StateStore, caplog: pytest.LogCaptureFixture
) -> None:
    records = history_records("both")
    saved_session = replay("both", None, records[:3])  # written after the third change
    assert saved_session is not None
    save(state_store, saved_session)
    write_journal(state_store, "both", records)
    alone = history_records("alone")
    write_journal(state_store, "alone", alone)
    state_store.append_log("alone", encode_record(delete_record(99))[:-4])  # torn
    gone = replay("gone", None, history_records("gone"))
    assert gone is not None
    save(state_store, gone)
    write_journal(state_store, "gone", [delete_record(7)])
    current = replay("current", None, history_records("current"))
    assert current is not None
    save(state_store, current)
    write_journal(state_store, "current", history_records("current"))  # compaction was missing
    if isinstance(state_store, DirectoryStore):
        (state_store.root / "journal" / ".tmp-x.journal-123").write_bytes(b"leftover")

    with caplog.at_level(logging.WARNING):
        recovered = recover_sessions(state_store, FINGERPRINT)

    by_id = {session.id: session for session in recovered.sessions}
    assert sorted(by_id) == ["alone", "both", "current"]
    expected = replay("x", None, history_records())
    assert expected is not None
    for session in by_id.values():
        assert session.transcript == expected.transcript and session.lsn == 5
    assert by_id["both"].on_disk and by_id["both"].stored_tokens == 4 and by_id["both"].disk_stale
    assert not by_id["alone"].on_disk
    assert recovered.from_journal == 2 and recovered.last_lsn == 7
    torn = [record for record in caplog.records if "torn" in record.getMessage()]
    assert len(torn) == 1 and "alone" in torn[0].getMessage()
    assert decode_journal(state_store.read_log("alone")).torn_bytes == 0  # cut off the journal
    assert state_store.log_names() == ["alone", "both"]
    assert state_store.bundle_names(Area.SESSIONS) == ["both", "current"]
    if isinstance(state_store, DirectoryStore):
        assert sorted(path.name for path in (state_store.root / "journal").iterdir()) == [
            "alone.journal",
            "both.journal",
        ]
        assert sorted(path.name for path in (state_store.root / "sessions").iterdir()) == ["both", "current"]


def test_a_damaged_journal_skips_its_session_and_leaves_it_alone(
    state_store: StateStore, caplog: pytest.LogCaptureFixture
) -> None:
    offsets = write_journal(state_store, "bad", history_records("bad"))
    damaged = bytearray(state_store.read_log("bad"))
    damaged[offsets[2] + HEADER.size] ^= 1
    state_store.replace_log("bad", bytes(damaged))
    with caplog.at_level(logging.WARNING):
        recovered = recover_sessions(state_store, FINGERPRINT)
    assert recovered.sessions == [] and state_store.read_log("bad") == bytes(damaged)
    assert "not resuming session bad" in caplog.text and "damaged" in caplog.text


def test_store_writes_in_order_compacts_deletes_and_counts(state_store: StateStore) -> None:
    state_store.prepare(Area.JOURNAL, exclusive=True)

    async def scenario() -> None:
        journal = SessionJournal(state_store, appending=True)
        session = new_session("a")
        journal.rewrite("a", session_record(session))
        for lsn in range(2, 40):
            session.lsn = lsn
            journal.append("a", turn_record(session, [USER]))
        journal.append("b", session_record(new_session("b")))
        await journal.settled("a")
        assert [record["lsn"] for record in read_journal(state_store, "a")] == list(range(1, 40))
        assert journal.sizes["a"] == state_store.log_size("a") == journal.stored_bytes(["a", "none", "not/an id"])
        journal.compact("a")
        await journal.delete("b", 41)
        assert read_journal(state_store, "b") == [delete_record(41)]
        journal.forget("b", 41)
        await journal.close()
        assert state_store.log_names() == [] and journal.sizes == {}
        assert journal.counters.appends == 41 and journal.counters.failures == 0

    asyncio.run(scenario())


def test_a_session_created_again_is_recovered_from_its_journal_without_the_old_bundle(state_store: StateStore) -> None:
    old = new_session("reborn", lsn=2)
    save(state_store, old)
    edit_manifest(state_store, "reborn", '"weights": "w"', '"weights": "another model"')
    records = [delete_record(3), {**history_records("reborn")[0], "lsn": 4}, {**history_records("reborn")[1], "lsn": 5}]
    write_journal(state_store, "reborn", records)
    (session,) = recover_sessions(state_store, FINGERPRINT).sessions
    assert session.transcript == [{"role": "system", "content": "Be brief."}, USER, REPLY] and not session.on_disk
    old.lsn = 6
    save(state_store, old)  # the same bundle, now newer than the journal, but of another model
    edit_manifest(state_store, "reborn", '"weights": "w"', '"weights": "another model"')
    assert recover_sessions(state_store, FINGERPRINT).sessions == []


def stored(count: int, created_at: float) -> dict:
    """A stored response's record, as a response chain keeps it in its annotations."""
    return {"count": count, "created_at": created_at, "response": {"id": f"resp_{count}"}, "input_items": []}


def new_chain(session_id: str, lsn: int = 1) -> Session:
    """A response chain with one stored response, as /v1/responses leaves it."""
    chain = Session(session_id, SessionSettings(), [USER, REPLY], owner="alice-hash", kind=SessionKind.RESPONSES)
    chain.annotations = {"responses": {"resp_2": stored(2, 1.0)}}
    chain.lsn = lsn
    return chain


def test_response_chains_are_recovered_with_kind_annotations_owner_and_stored_tokens(
    state_store: StateStore, caplog: pytest.LogCaptureFixture
) -> None:
    saved = new_chain("saved")
    save(state_store, saved, tokens=6)  # as the bundle reader found it, with nothing newer
    both = new_chain("both")
    save(state_store, both)
    changes = []
    both.lsn = 2
    changes.append(turn_record(both, [{"role": "user", "content": "more"}, REPLY]))
    both.lsn = 3
    changes.append(annotation_record(both, "responses", "resp_4", stored(4, 2.0)))  # the turn's response kept
    both.lsn = 4
    changes.append(annotation_record(both, "responses", "resp_2", None))  # an older one deleted
    write_journal(state_store, "both", changes)
    alone = new_chain("alone", lsn=5)  # never saved as a bundle: the journal alone
    write_journal(state_store, "alone", [session_record(alone)])
    odd = new_chain("odd")
    save(state_store, odd)
    edit_manifest(state_store, "odd", '"kind": "responses"', '"kind": "mystery"')

    with caplog.at_level(logging.WARNING):
        by_id = {session.id: session for session in recover_sessions(state_store, FINGERPRINT).sessions}

    assert sorted(by_id) == ["alone", "both", "saved"]
    assert "not resuming session odd: unknown kind 'mystery'" in caplog.text
    for session in by_id.values():
        assert session.kind is SessionKind.RESPONSES and session.owner == "alice-hash"
    assert by_id["saved"].annotations == saved.annotations and by_id["saved"].transcript == [USER, REPLY]
    assert by_id["saved"].on_disk and by_id["saved"].stored_tokens == 6 and not by_id["saved"].disk_stale
    assert by_id["both"].annotations == {"responses": {"resp_4": stored(4, 2.0)}} and by_id["both"].lsn == 4
    assert by_id["both"].transcript == [USER, REPLY, {"role": "user", "content": "more"}, REPLY]
    assert by_id["both"].on_disk and by_id["both"].stored_tokens == 4 and by_id["both"].disk_stale
    assert by_id["alone"].annotations == alone.annotations and not by_id["alone"].on_disk


def test_annotation_records_set_and_remove_one_entry_and_refuse_nonsense() -> None:
    chain = new_chain("c")
    chain.lsn = 2
    put = annotation_record(chain, "responses", "resp_4", stored(4, 2.0))
    chain.lsn = 3
    drop = annotation_record(chain, "responses", "resp_2", None)
    recovered = replay("c", None, [session_record(new_chain("c")), put, drop])
    assert recovered is not None and recovered.annotations == {"responses": {"resp_4": stored(4, 2.0)}}
    for damaged in ({**put, "value": [1]}, {**put, "key": 7}, {**put, "name": None}):
        with pytest.raises(JournalCorruptError, match="annotation"):
            replay("c", new_chain("c"), [damaged])


def test_a_deletion_cut_short_by_a_crash_is_finished_at_recovery(
    state_store: StateStore, caplog: pytest.LogCaptureFixture
) -> None:
    for session_id in ("deleted", "reborn", "damaged"):  # each bundle half removed: its manifest went first
        save(state_store, new_session(session_id, lsn=5))
        rest = {file: state_store.read_file(Area.SESSIONS, session_id, file) for file in (TOKENS, TRANSCRIPT, KV)}
        state_store.write_bundle(Area.SESSIONS, session_id, rest)
    write_journal(state_store, "deleted", [delete_record(6)])  # durable before the bundle went
    write_journal(state_store, "reborn", [delete_record(6), {**history_records("reborn")[0], "lsn": 7}])

    with caplog.at_level(logging.WARNING):
        (reborn,) = recover_sessions(state_store, FINGERPRINT).sessions

    assert reborn.id == "reborn" and reborn.lsn == 7 and not reborn.on_disk
    assert reborn.transcript == [{"role": "system", "content": "Be brief."}]
    assert state_store.bundle_names(Area.SESSIONS) == ["damaged", "reborn"]  # reborn's: replaced later
    assert state_store.log_names() == ["reborn"]
    assert "not resuming session damaged" in caplog.text and "deleted" not in caplog.text
