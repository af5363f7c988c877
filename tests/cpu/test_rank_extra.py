"""rank.json's `extra` is a typed record (manifest.RankExtra): parsed and checked once when the record is read, each
malformed key refused naming it, and written back to the same JSON keys, so archives keep their format.

The format proof: tests/cpu/data/rank-record-before-rank-extra.json is the rank.json SAVE's own code
(save.Saver._write, save_record_fixture) wrote before `extra` was typed; it reads into the same typed values, writes
back to the same bytes, and SAVE's code today writes the same record for the same preparation.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from archive_fixtures import forge, write_loadable_archive
from save_record_fixture import GOLDEN, NOTES, prepared, write_one_rank
from test_save_before_write import save_module, two_gpu_host  # noqa: F401  (fixtures)

from graphpersist.archive import ArchiveError, codec, open_archive
from graphpersist.archive import digests as archive_digests
from graphpersist.archive.manifest import HostMemoryRecord, ManifestError, RankExtra, RankRecord, RecordDigests
from graphpersist.loadplan import read_plan
from graphpersist.memory.phases import Phase
from graphpersist.memory.state import StateRecord

SHA = "ab" * 32


@pytest.fixture
def standin_save(save_module: ModuleType, monkeypatch: pytest.MonkeyPatch) -> ModuleType:  # noqa: F811
    """save.py as SAVE runs it in a rank's process, on CUDA device 0 (the stand-in torch's)."""
    monkeypatch.setattr(save_module.torch.cuda, "current_device", lambda: 0, raising=False)
    return save_module


def expected_extra(save: ModuleType) -> dict[str, Any]:
    """The typed values SAVE's preparation (save_record_fixture.prepared) must read back as, key by key."""
    _saver, prep = prepared(save)
    return {
        "setup_events": prep.mark.events,
        "setup_cursor": prep.mark.cursor,
        "granularity": prep.info.granularity,
        "phases": tuple(prep.phases),
        "state": tuple(r for r, _ in prep.states),
        "engine_notes": NOTES,
        "pointer_phases": prep.pointer_phases,
        "variable_pointers": tuple(tuple(v) for v in prep.variable_pointers),
        "torch_blocks": tuple(prep.torch_blocks),
    }


def assert_reads_as_saved(extra: RankExtra, save: ModuleType) -> None:
    for key, want in expected_extra(save).items():
        assert getattr(extra, key) == want, key
    assert all(isinstance(p, Phase) for p in extra.phases or ()) and all(
        isinstance(s, StateRecord) for s in extra.state or ()
    )
    assert extra.address_fingerprints is not None and sorted(extra.address_fingerprints) == ["full-bs1", "full-bs8"]
    assert isinstance(extra.digests, RecordDigests) and "rank_0/graphs/pack.bin" in extra.digests.files


# ------------------------------------------------------------------------------------------ the on-disk format


def test_a_record_written_before_extra_was_typed_reads_the_same_and_writes_back_the_same_bytes(
    standin_save: ModuleType,
) -> None:
    text = GOLDEN.read_bytes()
    record, doc = codec.parsed(RankRecord, text)
    assert_reads_as_saved(record.extra, standin_save)
    assert codec.to_json(record).encode() == text  # same keys, same order, same values
    assert codec.to_dict(record) == doc
    assert record.extra.digests is not None and archive_digests.record_digest(doc) == record.extra.digests.record


def test_save_writes_the_record_it_wrote_before_extra_was_typed(standin_save: ModuleType, tmp_path: Path) -> None:
    """SAVE's own code, today, for the preparation that made the saved record: the same rank.json. Only the digests
    may differ (the graph pack holds zlib output, whose bytes depend on the zlib Python was built with)."""
    archive_root = write_one_rank(standin_save, tmp_path / "archive")
    text = (archive_root / "rank_0" / "rank.json").read_bytes()
    now, before = json.loads(text), json.loads(GOLDEN.read_bytes())
    assert set(now["extra"].pop("digests")["files"]) == set(before["extra"].pop("digests")["files"])
    assert now == before
    archive = open_archive(archive_root)  # its digests verify
    record = archive.rank_facts(0)
    assert codec.to_json(record).encode() == text
    assert_reads_as_saved(record.extra, standin_save)
    plan = read_plan(archive, 0, every_byte=True)  # what LOAD takes from it
    assert plan.phases == list(record.extra.phases or ()) and plan.states == list(record.extra.state or ())
    assert plan.torch_blocks == list(record.extra.torch_blocks or ()) and plan.notes == NOTES
    assert plan.phases[0] is not record.extra.phases[0]  # LOAD's recorder gets copies, never the record's own


# ------------------------------------------------------------------------------------------ round trips


def full_extra() -> RankExtra:
    return RankExtra(
        setup_events=2,
        setup_cursor=1 << 26,
        address_fingerprints={"full-bs8": SHA},
        granularity=2 << 20,
        phases=(Phase("(setup)", implicit=True, start_event=0, end_event=2, start=0, end=1 << 26, limit=1 << 26),),
        state=(StateRecord("peer_ptrs", 1 << 40, 64, "recreated", SHA, "custom_all_reduce", None),),
        engine_notes={"full": {"full-bs8": {"size": 8}}, "deep": [[1.5, None, "x"]]},
        pointer_phases={"(setup)": 7},
        variable_pointers=((1 << 40, "kv_cache"),),
        torch_blocks=((1 << 40, 4096),),
        host_memory=HostMemoryRecord(ranges=((0x4F0000000000, 4096),), words=3),
        digests=RecordDigests(files={"rank_0/alloc_log.json": SHA}, record=SHA),
    )


def a_record(extra: Any) -> dict[str, Any]:
    return {
        "rank": 0,
        "device": {"index": 0, "uuid": "GPU-x", "pci_bus_id": "0000:19:00.0"},
        "region": {"base": 1 << 40, "size": 1 << 36, "final_offset": 0},
        "pointers": {"fingerprint": SHA, "count": 0},
        "extra": extra,
    }


def test_saves_write_summary_splits_its_seconds_into_images_records_and_files(
    standin_save: ModuleType, tmp_path: Path
) -> None:
    """The engines log the split (graphpersist.breakdown.of_save): where the write of a SAVE's files goes."""
    from save_record_fixture import ONE_RANK, world

    from graphpersist.archive import ArchiveWriter

    saver, prep = prepared(standin_save)
    with ArchiveWriter(tmp_path / "a", world(**ONE_RANK)) as writer:
        started = time.perf_counter()
        summary = saver._write(writer, 0, prep, dict(NOTES))
        took = time.perf_counter() - started
        writer.commit()
    parts = summary["write_split_s"]
    assert list(parts) == ["images", "records", "files"]
    assert min(parts.values()) >= 0 and 0 < sum(parts.values()) <= took


def test_every_key_round_trips_through_json() -> None:
    extra = full_extra()
    doc = a_record(codec.to_dict(extra))
    record = codec.from_dict(RankRecord, doc)
    assert record.extra == extra
    assert codec.from_json(RankRecord, codec.to_json(record)) == record
    assert json.loads(codec.to_json(record))["extra"] == codec.to_dict(extra) == doc["extra"]
    assert list(codec.to_dict(extra)) == [f.name for f in dataclasses.fields(RankExtra)]  # SAVE's order of keys


def test_absent_keys_stay_absent_and_no_extra_reads_as_none() -> None:
    """Older SAVEs wrote fewer keys: none is invented when such a record is read and written back."""
    doc = a_record({"engine_notes": {"k": 1}, "torch_blocks": []})
    record = codec.from_dict(RankRecord, doc)
    assert codec.to_dict(record)["extra"] == {"engine_notes": {"k": 1}, "torch_blocks": []}
    assert record.extra.phases is None and record.extra.torch_blocks == () and record.engine_notes() == {"k": 1}
    bare = codec.from_dict(RankRecord, {k: v for k, v in doc.items() if k != "extra"})
    assert bare.extra == RankExtra() and codec.to_dict(bare)["extra"] == {} and bare.engine_notes() == {}


def test_null_engine_notes_read_as_no_notes() -> None:
    assert codec.from_dict(RankRecord, a_record({"engine_notes": None})).engine_notes() == {}


def test_engine_notes_are_a_copy() -> None:
    record = codec.from_dict(RankRecord, a_record({"engine_notes": {"k": 1}}))
    record.engine_notes()["k"] = 2
    assert record.engine_notes() == {"k": 1}


# ------------------------------------------------------------------------------------------ refusals


def _set(extra: dict[str, Any], dotted: str, value: Any) -> None:
    """extra[dotted path] = value; path parts that are digits index lists ("phases.0.start")."""
    *parents, last = [int(p) if p.isdigit() else p for p in dotted.split(".")]
    node: Any = extra
    for key in parents:
        node = node[key]
    node[last] = value


# (where, the value put there, what the refusal must say after "extra")
MALFORMED: list[tuple[str, Any, str]] = [
    ("note", 1, r": unknown field\(s\) note for this format version$"),
    ("setup_events", "2", r"\.setup_events: must be an integer from 0 to 2\*\*64-1, got '2'$"),
    ("setup_cursor", -1, r"\.setup_cursor: must be an integer .*got -1$"),
    ("granularity", 1.5, r"\.granularity: must be an integer .*got 1\.5$"),
    ("address_fingerprints", [], r"\.address_fingerprints: must be an object"),
    ("address_fingerprints.full-bs8", 7, r"\.address_fingerprints\.full-bs8: must be a string, got 7$"),
    ("phases", "all of them", r"\.phases: must be a list, got 'all of them'$"),
    ("phases", None, r"\.phases: must be a list, got None$"),
    ("phases.0", 7, r"\.phases\[0\]: must be an object, got 7$"),
    ("phases.0.name", 7, r"\.phases\[0\]: needs a name and only Phase's fields"),
    ("phases.0.anchor", 7, r"\.phases\[0\]: needs a name and only Phase's fields"),
    ("phases.0.exact", 1, r"\.phases\[0\]\.exact: must be true or false, got 1$"),
    ("phases.0.start", "0x4000000", r"\.phases\[0\]\.start: must be an integer"),
    ("phases.0.span", -4096, r"\.phases\[0\]\.span: must be an integer"),
    ("phases.0.start_event", 3, r"\.phases\[0\]: events 3\.\.2 out of order$"),
    ("phases.0.limit", 1, r"\.phases\[0\]: offsets start 0, end \d+, limit 1 out of order$"),
    ("state", {}, r"\.state: must be a list"),
    ("state.0.bytes", 1, r"\.state\[0\]: must be an object of StateRecord's fields$"),
    ("state.0.how", "copied", r"\.state\[0\]: needs a name, how \(bytes or recreated\) and a sha256$"),
    ("state.0.sha256", "AB" * 32, r"\.state\[0\]: needs a name, how"),
    ("state.0.addr", 0, r"\.state\[0\]\.addr: must be an integer from 1 to"),
    ("state.0.nbytes", "64", r"\.state\[0\]\.nbytes: must be an integer from 1 to"),
    ("state.0.phase", 3, r"\.state\[0\]\.phase: must be a phase name or null, got 3$"),
    ("state.0.file", "state/0.bin", r"\.state\[0\]\.file: names the payload of a 'bytes' state, and only of one$"),
    ("engine_notes", ["not", "an", "object"], r"\.engine_notes: must be an object"),
    ("pointer_phases.(setup)", -1, r"\.pointer_phases\.\(setup\): must be an integer"),
    ("variable_pointers.0", [1], r"\.variable_pointers\[0\]: must be \[address, phase\]"),
    ("variable_pointers.0.1", 2, r"\.variable_pointers\[0\]\[1\]: must be a phase name, got 2$"),
    ("torch_blocks", {}, r"\.torch_blocks: must be a list"),
    ("torch_blocks.0", [1, 2, 3], r"\.torch_blocks\[0\]: must be \[address, size\]"),
    ("torch_blocks.0.0", "0x1", r"\.torch_blocks\[0\]\[0\]: must be an integer"),
    ("host_memory", [], r"\.host_memory: must be an object with exactly `ranges` and `words`$"),
    ("host_memory.words", -1, r"\.host_memory\.words: must be an integer"),
    ("host_memory.ranges.0", [1], r"\.host_memory\.ranges\[0\]: must be \[address, size\]"),
    ("digests", "x", r"\.digests: must be an object with `files`, `record` and \(rank 0's\) `manifest`$"),
    ("digests.record", "abc", r"\.digests\.record: must be a sha256 \(64 lower-case hex digits\)$"),
    ("digests.files.rank_0/x", "no", r"\.digests\.files: must map archive paths to sha256s$"),
]


@pytest.mark.parametrize(("where", "value", "says"), MALFORMED, ids=[f"{w}={v!r}"[:40] for w, v, _ in MALFORMED])
def test_each_malformed_key_is_refused_naming_it(where: str, value: Any, says: str) -> None:
    extra = codec.to_dict(full_extra())
    _set(extra, where, value)
    with pytest.raises(ManifestError, match="^extra" + says):
        codec.from_dict(RankExtra, extra)
    with pytest.raises(ManifestError, match="^extra" + says):  # the record's own parser says the same
        codec.from_dict(RankRecord, a_record(extra))


def test_extra_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(ManifestError, match=r"^extra: must be an object, got a list of 0 items$"):
        codec.from_dict(RankRecord, a_record([]))


@pytest.mark.parametrize(
    ("change", "names"),
    [
        (lambda d: d["extra"]["phases"][1].update(start="0x4000000"), "extra.phases[1].start: must be an integer"),
        (lambda d: d["extra"]["state"][0].update(how="copied"), "extra.state[0]: needs a name, how"),
        (lambda d: d["extra"].update(torch_blocks=[["0x1", 4]]), "extra.torch_blocks[0][0]: must be an integer"),
        (lambda d: d["extra"].update(engine_notes=7), "extra.engine_notes: must be an object"),
        (lambda d: d["extra"].update(note="kept by someone"), "extra: unknown field(s) note"),
    ],
)
def test_a_forged_archive_is_refused_when_opened_naming_file_and_field(
    tmp_path: Path, change: Callable[[Any], None], names: str
) -> None:
    """Forged as a forger would (the file table and the record's own digest recomputed): every reader refuses it
    at open_archive, before any of them reads a value, with the file and the key."""
    root = write_loadable_archive(tmp_path / "archive")
    doc = json.loads((root / "rank_0" / "rank.json").read_bytes())
    change(doc)
    forge(root, "rank_0/rank.json", json.dumps(doc, indent=2).encode())
    for keep_rank in (None, 0, 1):
        with pytest.raises(ArchiveError) as info:
            open_archive(root, keep_rank=keep_rank)
        assert f"rank_0/rank.json: {names}" in str(info.value)


def test_the_writer_refuses_a_malformed_extra_before_it_writes_the_record(tmp_path: Path) -> None:
    """SAVE fails on the value it was given, not a later LOAD (ArchiveWriter.set_rank_facts)."""
    from archive_fixtures import device, world

    from graphpersist.archive import ArchiveWriter

    with ArchiveWriter(tmp_path / "a", world()) as writer:
        facts = a_record({"torch_blocks": [[1 << 40]]}) | {"device": device(0)}
        with pytest.raises(ArchiveError, match=r"invalid facts for rank 0: extra\.torch_blocks\[0\]: must be"):
            writer.set_rank_facts(0, facts)
        given = a_record(copy.deepcopy(codec.to_dict(full_extra()))) | {"device": device(0)}
        with pytest.raises(ArchiveError, match=r"extra\.digests is written by the archive writer, not given"):
            writer.set_rank_facts(0, given)
