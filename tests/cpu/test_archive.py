"""Archives are written atomically and read back only when every byte matches the manifest."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from archive_fixtures import GPU_UUIDS, PCI_BUS_IDS, device, forge, world, write_archive, write_rank

from graphpersist.archive import ArchiveError, ArchiveWriter, open_archive, remove_stale_partials
from graphpersist.archive import side as archive_side
from graphpersist.archive import world as world_mod
from graphpersist.archive import write as archive_write
from graphpersist.archive.base import ADVICE_DAMAGED, ADVICE_MISSING
from graphpersist.archive.manifest import FORMAT_VERSION, DeviceFacts, RankRecord

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    return write_archive(tmp_path / "archive")


def error_of(root: Path, **kwargs) -> str:
    with pytest.raises(ArchiveError) as info:
        open_archive(root, **kwargs)
    return str(info.value)


def siblings(root: Path) -> list[str]:
    return sorted(p.name for p in root.parent.iterdir() if p.name != root.name)


# --- round trip


def test_written_archive_reads_back(saved: Path):
    archive = open_archive(saved)
    assert archive.ranks == (0, 1)
    assert archive.manifest.format_version == FORMAT_VERSION
    assert archive.manifest.world.parallel.tp_size == 2
    assert archive.read_json(None, "engine.json") == {"kv_cache_blocks": 4096}
    record = archive.rank_facts(1)
    assert isinstance(record, RankRecord) and record.rank == 1
    assert record.device == DeviceFacts(index=1, uuid=GPU_UUIDS[1], pci_bus_id=PCI_BUS_IDS[1])
    graph = record.graphs[0]
    assert json.loads(archive.read_path(graph.file))["nodes"][0]["type"] == "kernel"
    image = record.images[0]
    assert (
        archive.read(1, image.file.removeprefix("rank_1/"))[:4] == archive.file_path(1, image.file[7:]).read_bytes()[:4]
    )
    assert set(archive.names(1)) == {
        "allocations.log",
        *(i.file[7:] for i in record.images),
        *(g.file[7:] for g in record.graphs),
    }
    assert archive.names(None) == ["engine.json"]


def test_manifest_is_written_last_and_lists_every_file(saved: Path):
    manifest = json.loads((saved / "manifest.json").read_text())
    on_disk = {p.relative_to(saved).as_posix() for p in saved.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk
    assert all(entry["size"] == (saved / rel).stat().st_size for rel, entry in manifest["files"].items())
    assert siblings(saved) == [], "no staging or trash folder may be left behind"


def test_two_saves_of_the_same_content_have_equal_file_tables(tmp_path: Path):
    one = open_archive(write_archive(tmp_path / "one")).manifest
    two = open_archive(write_archive(tmp_path / "two")).manifest
    assert one.files == two.files and one.world == two.world


# --- what readers refuse, each with its own message


def test_missing_directory(tmp_path: Path):
    assert (
        error_of(tmp_path / "nope") == f"graphpersist: cannot open archive {tmp_path / 'nope'}: no such directory\n"
        f"{ADVICE_MISSING}"
    )


def test_directory_without_manifest_is_not_an_archive(saved: Path):
    (saved / "manifest.json").unlink()
    assert "no manifest.json: the SAVE did not finish" in error_of(saved)


def test_garbled_manifest(saved: Path):
    (saved / "manifest.json").write_text('{"format": "graphpersist-archive", "format_vers')
    assert "manifest.json is unreadable: manifest.json is not valid JSON" in error_of(saved)


def test_manifest_missing_a_field(saved: Path):
    data = json.loads((saved / "manifest.json").read_text())
    del data["world"]["model"]["dtype"]
    (saved / "manifest.json").write_text(json.dumps(data))
    assert "manifest.world.model.dtype is missing" in error_of(saved)


def test_unsupported_format_version(saved: Path):
    data = json.loads((saved / "manifest.json").read_text())
    data["format_version"] = FORMAT_VERSION + 1
    (saved / "manifest.json").write_text(json.dumps(data))
    message = error_of(saved)
    assert f"archive format version {FORMAT_VERSION + 1} is newer than what this graphpersist reads" in message
    assert message.splitlines()[-1].startswith("Use the graphpersist release that wrote it")


def test_an_archive_of_an_older_format_asks_for_a_new_save(saved: Path):
    data = json.loads((saved / "manifest.json").read_text())
    data["format_version"] = 1
    (saved / "manifest.json").write_text(json.dumps(data))
    assert error_of(saved).splitlines() == [
        f"graphpersist: cannot open archive {saved}: archive format version 1 is older than what this graphpersist "
        f"reads (format {FORMAT_VERSION})",
        f"Re-run with mode=save to write it again in format {FORMAT_VERSION} "
        "(LOAD now compares facts that older formats did not record).",
    ]


def test_missing_file(saved: Path):
    (saved / "rank_1" / "allocations.log").unlink()
    assert error_of(saved).splitlines()[0].endswith(": missing file rank_1/allocations.log (listed in manifest.json)")


def test_truncated_file(saved: Path):
    path = saved / "rank_0" / "allocations.log"
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:100])
    assert f"truncated file rank_0/allocations.log: 100 bytes, manifest.json says {size}" in error_of(saved)


def test_oversized_file(saved: Path):
    path = saved / "rank_0" / "allocations.log"
    path.write_bytes(path.read_bytes() + b"x")
    assert "oversized file rank_0/allocations.log" in error_of(saved)


def test_corrupted_file_same_size(saved: Path):
    path = saved / "engine.json"
    data = bytearray(path.read_bytes())
    data[3] ^= 0x01
    path.write_bytes(bytes(data))
    assert "corrupted file engine.json: sha256 " in error_of(saved)


def test_extra_file_is_refused(saved: Path):
    (saved / "rank_0" / "stray.bin").write_bytes(b"?")
    assert "unexpected file rank_0/stray.bin (not listed in manifest.json)" in error_of(saved)


def test_corrupt_rank_record_is_reported_once(saved: Path):
    path = saved / "rank_1" / "rank.json"
    path.write_bytes(path.read_bytes()[:-5])
    message = error_of(saved)
    assert "truncated file rank_1/rank.json" in message
    assert message.count("rank_1/rank.json") == 1


def test_all_problems_are_listed(saved: Path):
    (saved / "rank_0" / "allocations.log").unlink()
    (saved / "rank_1" / "allocations.log").write_bytes(b"short")
    (saved / "extra").write_bytes(b"")
    lines = error_of(saved).splitlines()
    assert lines[0] == f"graphpersist: cannot open archive {saved}: 3 problems"
    assert [line.split()[0] for line in lines[1:4]] == ["missing", "truncated", "unexpected"]
    assert lines[-1] == ADVICE_DAMAGED, "damage is not fixed by a new SAVE: the advice says how to get it back"


def test_read_verifies_the_bytes_it_returns(saved: Path):
    archive = open_archive(saved)
    path = saved / "rank_0" / "allocations.log"
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ArchiveError, match=r"corrupted file rank_0/allocations\.log"):
        archive.read(0, "allocations.log")


def test_skipping_checksums_at_open_still_checks_sizes_and_reads(saved: Path):
    path = saved / "engine.json"
    data = bytearray(path.read_bytes())
    data[3] ^= 0x01
    path.write_bytes(bytes(data))
    archive = open_archive(saved, verify_checksums=False)
    with pytest.raises(ArchiveError, match=r"corrupted file engine\.json"):
        archive.read_json(None, "engine.json")
    path.write_bytes(b"{}")
    assert "truncated file engine.json" in error_of(saved, verify_checksums=False)


def test_unknown_names_and_ranks(saved: Path):
    archive = open_archive(saved)
    with pytest.raises(ArchiveError, match="it has no file rank_0/nope"):
        archive.read(0, "nope")
    with pytest.raises(ArchiveError, match=r"it holds no rank 5 \(ranks \[0, 1\]\)"):
        archive.rank_facts(5)


# --- hostile content: refused with its problem named, never a traceback


def rewrite_manifest(root: Path, change) -> None:
    data = json.loads((root / "manifest.json").read_text())
    change(data)
    (root / "manifest.json").write_text(json.dumps(data, indent=2))


def rewrite_record(root: Path, rel: str, text: str) -> None:
    """Replaces a listed file as a forger would (its table entry and the record that commits to it made to match:
    archive_fixtures.forge), so the new text reaches the parser."""
    forge(root, rel, text.encode())


def raw_manifest(root: Path, old: str, new: str) -> None:
    text = (root / "manifest.json").read_text()
    assert old in text
    (root / "manifest.json").write_text(text.replace(old, new, 1))


def test_a_huge_integer_in_the_manifest_is_refused(saved: Path):
    raw_manifest(saved, '"world_size": 2', '"world_size": ' + "9" * 5000)
    assert (
        error_of(saved)
        .splitlines()[0]
        .endswith(
            "manifest.json is unreadable: manifest.json is not valid JSON: integer " + "9" * 59 + "… (5000 characters) "
            "does not fit in 64 bits"
        )
    )


def test_deep_nesting_in_the_manifest_is_refused(saved: Path):
    raw_manifest(saved, '"flags": {', '"deep": ' + "[" * 100_000 + "]" * 100_000 + ', "flags": {')
    assert "manifest.json is not valid JSON: nested too deeply" in error_of(saved)
    raw_manifest(saved, '"deep": ' + "[" * 100_000 + "]" * 100_000, '"deep": ' + "[" * 40 + "]" * 40)
    assert "manifest.json is not valid JSON: nested deeper than 32 levels" in error_of(saved)


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        ('"tp_size": 2', '"tp_size": NaN', "NaN is not a JSON number"),
        ('"tp_size": 2', '"tp_size": 1e999', "number 1e999 is out of range"),
        (
            '"tp_size": 2',
            '"tp_size": -1',
            "manifest.world.parallel.tp_size must be an integer from 0 to 2**64-1, got -1",
        ),
        ('"tp_size": 2', '"tp_size": "2"', "manifest.world.parallel.tp_size must be an integer from 0 to 2**64-1"),
        ('"tp_size": 2', '"tp_size": 2, "tp_size": 2', "duplicate key 'tp_size' in one object"),
        ('"dtype": "bfloat16"', '"dtype": "\\udc80"', "holds a lone UTF-16 surrogate (\\udc80), not text"),
    ],
)
def test_mistyped_or_invalid_manifest_values_are_named(saved: Path, old: str, new: str, problem: str):
    raw_manifest(saved, old, new)
    message = error_of(saved)
    assert problem in message and message.startswith(f"graphpersist: cannot open archive {saved}: ")


def test_values_of_the_wrong_shape_are_named(saved: Path):
    rewrite_manifest(saved, lambda m: m.update(ranks="0,1"))
    assert "manifest.ranks must be a list, got str" in error_of(saved)
    rewrite_manifest(saved, lambda m: m.update(ranks=[0, 1], world=["everything"]))
    assert "manifest.world must be an object, got list" in error_of(saved)


def test_a_manifest_that_is_not_utf8_is_refused(saved: Path):
    (saved / "manifest.json").write_bytes((saved / "manifest.json").read_bytes().replace(b"vllm", b"v\xffllm", 1))
    assert "manifest.json is not valid JSON: not UTF-8 text: byte 0xff at offset" in error_of(saved)


def test_negative_sizes_and_escaping_paths_in_the_file_table(saved: Path):
    def change(m):
        m["files"]["rank_0/allocations.log"]["size"] = -5
        m["files"]["../outside"] = m["files"].pop("engine.json")

    rewrite_manifest(saved, change)
    assert "manifest.files.rank_0/allocations.log.size must be an integer from 0 to 2**64-1, got -5" in error_of(saved)
    rewrite_manifest(saved, lambda m: m["files"]["rank_0/allocations.log"].update(size=8192))
    message = error_of(saved)
    assert "manifest.json lists an invalid path '../outside'" in message
    assert "unexpected file engine.json (not listed in manifest.json)" in message


@pytest.mark.parametrize(
    ("world_size", "ranks", "problem"),
    [
        (1, [0, 0], "ranks [0, 0] must be exactly 0 .. 0 (parallel.world_size 1): [0] listed more than once"),
        (2, [], "ranks [] must be exactly 0 .. 1 (parallel.world_size 2): missing [0, 1]"),
        (2, [0], "ranks [0] must be exactly 0 .. 1 (parallel.world_size 2): missing [1]"),
        (2, [1, 0], "ranks [1, 0] must be exactly 0 .. 1 (parallel.world_size 2): not in ascending order"),
        (1, [0, 1], "ranks [0, 1] must be exactly 0 .. 0 (parallel.world_size 1): [1] outside the world"),
        (0, [0, 1], "parallel.world_size is 0: it must be at least 1"),
    ],
)
def test_ranks_must_be_exactly_those_of_the_world(tmp_path: Path, world_size: int, ranks: list[int], problem: str):
    root = write_archive(tmp_path / "archive", **{"parallel.world_size": 2 if world_size != 1 else 1})

    def change(m):
        m["ranks"] = ranks
        m["world"]["parallel"]["world_size"] = world_size

    rewrite_manifest(root, change)
    assert f"manifest.json contradicts itself: {problem}" in error_of(root)


def test_rank_folders_the_ranks_do_not_name_are_refused(saved: Path):
    rewrite_manifest(saved, lambda m: m.update(ranks=[0]) or m["world"]["parallel"].update(world_size=1))
    message = error_of(saved)
    assert "manifest.json contradicts itself: the file table lists rank_1/, a rank that ranks do not name" in message


def test_a_rank_without_its_record_is_refused(saved: Path):
    (saved / "rank_1" / "rank.json").unlink()
    rewrite_manifest(saved, lambda m: m["files"].pop("rank_1/rank.json"))
    assert "manifest.json contradicts itself: rank 1 has no rank_1/rank.json in the file table" in error_of(saved)


def test_a_record_in_another_ranks_folder_is_refused(saved: Path):
    rewrite_record(saved, "rank_1/rank.json", (saved / "rank_0" / "rank.json").read_text())
    assert "rank_1/rank.json says rank 0, but it lies in the folder of rank 1" in error_of(saved)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[" * 100_000 + "]" * 100_000, "rank_0/rank.json: rank.json is not valid JSON: nested too deeply"),
        ('{"rank": ' + "1" * 4400 + "}", "does not fit in 64 bits"),
        ('"a string"', "rank_0/rank.json: rank must be an object, got str"),
        ("", "rank_0/rank.json: rank.json is not valid JSON: Expecting value at line 1 column 1"),
    ],
)
def test_a_hostile_rank_record_is_refused(saved: Path, text: str, problem: str):
    rewrite_record(saved, "rank_0/rank.json", text)
    assert problem in error_of(saved)


def test_links_are_never_followed(saved: Path, tmp_path: Path):
    (tmp_path / "copy").mkdir()
    os.rename(saved / "rank_0", tmp_path / "copy" / "rank_0")
    (saved / "rank_0").symlink_to(tmp_path / "copy" / "rank_0")
    message = error_of(saved)
    assert "rank_0/rank.json is not a regular file (rank_0 is a symbolic link)" in message
    assert "unexpected file rank_0 (not listed in manifest.json)" in message
    os.rename(saved / "manifest.json", tmp_path / "manifest.json")
    (saved / "manifest.json").symlink_to(tmp_path / "manifest.json")
    assert error_of(saved).splitlines()[0].endswith(": manifest.json is not a regular file")


def test_a_payload_with_invalid_json_is_refused_when_read(saved: Path):
    rewrite_record(saved, "engine.json", '{"kv_cache_blocks": NaN}')
    archive = open_archive(saved)
    with pytest.raises(ArchiveError, match=r"engine\.json is not valid JSON: NaN is not a JSON number"):
        archive.read_json(None, "engine.json")
    rewrite_record(saved, "engine.json", "[" * 100_000 + "]" * 100_000)
    with pytest.raises(ArchiveError, match=r"engine\.json is not valid JSON: nested too deeply"):
        open_archive(saved).read_json(None, "engine.json")


# --- what each rank record commits to (archive_digests)


def test_each_record_commits_to_its_files_and_to_itself(saved: Path):
    archive = open_archive(saved)
    for rank in archive.ranks:
        digests = archive.rank_facts(rank).extra.digests
        assert digests is not None
        own = {
            rel for rel in archive.manifest.files if rel.startswith(f"rank_{rank}/") and not rel.endswith("rank.json")
        }
        shared = {"engine.json"} if rank == 0 else set()
        assert set(digests.files) == own | shared
        assert all(archive.manifest.files[rel].sha256 == sha for rel, sha in digests.files.items())


def test_a_record_edited_and_its_table_entry_regenerated_is_refused(saved: Path):
    record = json.loads((saved / "rank_1" / "rank.json").read_bytes())
    record["device"]["index"] = 0  # "move" rank 1 to another GPU by hand
    (saved / "rank_1" / "rank.json").write_text(json.dumps(record, indent=2))
    data = (saved / "rank_1" / "rank.json").read_bytes()
    entry = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    rewrite_manifest(saved, lambda m: m["files"].update({"rank_1/rank.json": entry}))
    message = error_of(saved)
    assert "rank_1/rank.json does not hash to its extra.digests.record: it was changed after SAVE wrote it" in message
    assert message.splitlines()[-1] == ADVICE_DAMAGED


def test_a_shared_file_changed_and_its_table_entry_regenerated_is_refused(saved: Path):
    (saved / "engine.json").write_text('{"kv_cache_blocks": 8192}')
    data = (saved / "engine.json").read_bytes()
    entry = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    rewrite_manifest(saved, lambda m: m["files"].update({"engine.json": entry}))
    assert "engine.json: sha256" in error_of(saved) and "in rank_0/rank.json" in error_of(saved)


def test_a_record_whose_commitments_were_stripped_is_refused(saved: Path):
    for rank in (0, 1):
        rel = f"rank_{rank}/rank.json"
        record = json.loads((saved / rel).read_bytes())
        del record["extra"]["digests"]
        (saved / rel).write_text(json.dumps(record, indent=2))
        data = (saved / rel).read_bytes()
        entry = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        rewrite_manifest(saved, lambda m, rel=rel, entry=entry: m["files"].update({rel: entry}))
    message = error_of(saved)
    assert "rank_0/rank.json has no extra.digests" in message and "rank_1/rank.json has no extra.digests" in message


def test_shared_files_come_before_rank_0s_record(tmp_path: Path):
    with ArchiveWriter(tmp_path / "a", world()) as writer:
        write_rank(writer, 0)
        with pytest.raises(ArchiveError, match=r"shared files must be written before rank 0's record"):
            writer.add_shared({"late.json": b"{}"})


# --- the writer


def test_existing_archive_is_not_replaced_without_overwrite(saved: Path):
    with pytest.raises(ArchiveError, match="it already exists"):
        ArchiveWriter(saved, world())


@pytest.mark.parametrize("name", ["../x", "/abs", "a//b", "a/./b", "a\\b", ""])
def test_file_names_cannot_escape_the_archive(tmp_path: Path, name: str):
    with ArchiveWriter(tmp_path / "a", world()) as writer, pytest.raises(ValueError):
        writer.add_file(0, name, b"")


def test_reserved_names(tmp_path: Path):
    with ArchiveWriter(tmp_path / "a", world()) as writer:
        for rank, name in [(None, "manifest.json"), (None, "rank_0/x"), (0, "rank.json")]:
            with pytest.raises(ValueError):
                writer.add_file(rank, name, b"")
        writer.add_file(0, "x", b"1")
        with pytest.raises(ArchiveError, match="rank_0/x was already written"):
            writer.add_file(0, "x", b"2")


def test_invalid_world_or_rank_facts_fail_the_save(tmp_path: Path):
    with pytest.raises(ArchiveError, match=r"invalid world facts: world\.parallel is missing"):
        ArchiveWriter(tmp_path / "a", {k: v for k, v in world().items() if k != "parallel"})
    with (
        ArchiveWriter(tmp_path / "a", world()) as writer,
        pytest.raises(ArchiveError, match=r"invalid facts for rank 0: rank\.region is missing"),
    ):
        writer.set_rank_facts(0, {"device": device(0), "pointers": {"fingerprint": "x", "count": 0}})
    assert siblings(tmp_path / "a") == []


def test_facts_the_reader_would_refuse_fail_the_save(tmp_path: Path):
    """Free-form facts (flags, extra) are JSON the strict reader must take back: NaN, huge or deep values fail now."""
    with pytest.raises(ArchiveError, match=r"invalid world facts: it cannot be written as JSON: Out of range float"):
        ArchiveWriter(tmp_path / "a", world(**{"flags.ratio": float("nan")}))
    with pytest.raises(ArchiveError, match=r"invalid world facts: it would not read back: integer .* 64 bits"):
        ArchiveWriter(tmp_path / "a", world(**{"flags.seed": 2**70}))
    deep: list = []
    for _ in range(40):
        deep = [deep]
    with ArchiveWriter(tmp_path / "a", world()) as writer:
        record = {
            "device": device(0),
            "region": {"base": 0, "size": 1, "final_offset": 0},
            "pointers": {"fingerprint": "x", "count": 0},
            "extra": {"engine_notes": {"deep": deep}},
        }
        with pytest.raises(ArchiveError, match=r"invalid facts for rank 0: it would not read back: nested deeper"):
            writer.set_rank_facts(0, record)
    assert siblings(tmp_path / "a") == []


def test_a_bare_device_index_is_expanded_to_the_gpu_it_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """api.py passes `"device": torch.cuda.current_device()`; the writer records which GPU that is."""
    looked_up = []

    def lookup(index: int) -> dict:
        looked_up.append(index)
        return device(1) | {"index": index}

    monkeypatch.setattr(world_mod, "rank_device_facts", lookup)
    facts = {"region": {"base": 1, "size": 2, "final_offset": 0}, "pointers": {"fingerprint": "x", "count": 0}}
    with ArchiveWriter(tmp_path / "a", world()) as writer:
        record = writer.set_rank_facts(0, facts | {"device": 1})
    assert looked_up == [1] and record.device == DeviceFacts(1, GPU_UUIDS[1], PCI_BUS_IDS[1])


def test_a_device_whose_gpu_cannot_be_named_fails_the_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def lookup(index: int) -> dict:
        raise world_mod.WorldError(f"cannot learn the uuid and pci_bus_id of CUDA device {index}")

    monkeypatch.setattr(world_mod, "rank_device_facts", lookup)
    facts = {"region": {"base": 1, "size": 2, "final_offset": 0}, "pointers": {"fingerprint": "x", "count": 0}}
    with (
        ArchiveWriter(tmp_path / "a", world()) as writer,
        pytest.raises(ArchiveError, match=r"cannot record rank 0's GPU: cannot learn the uuid and pci_bus_id of CUDA"),
    ):
        writer.set_rank_facts(0, facts | {"device": 0})


def test_commit_refuses_an_incomplete_archive_and_publishes_nothing(tmp_path: Path):
    root = tmp_path / "a"
    writer = ArchiveWriter(root, world())
    write_rank(writer, 0)  # world_size is 2: rank 1 never arrives
    with pytest.raises(ArchiveError, match=r"ranks written \[0\], expected \[0, 1\]"):
        writer.commit()
    assert not root.exists() and siblings(root) == []


def test_commit_refuses_records_that_name_missing_files(tmp_path: Path):
    root = tmp_path / "a"
    writer = ArchiveWriter(root, world(**{"parallel.world_size": 1}))
    facts = write_rank(writer, 0)
    (writer.staging / facts["graphs"][0]["file"]).unlink()
    with pytest.raises(ArchiveError, match=r"rank 0: graph full-bs1 names missing file rank_0/graphs/bs1\.json"):
        writer.commit()
    assert not root.exists()


def test_an_exception_inside_the_writer_leaves_nothing(tmp_path: Path):
    root = tmp_path / "a"
    with pytest.raises(RuntimeError, match="capture failed"), ArchiveWriter(root, world()) as writer:
        write_rank(writer, 0)
        raise RuntimeError("capture failed")
    assert not root.exists() and siblings(root) == []


def test_overwrite_keeps_the_old_archive_until_the_new_one_is_complete(saved: Path):
    old_manifest = (saved / "manifest.json").read_bytes()
    writer = ArchiveWriter(saved, world(**{"model.dtype": "float16"}), overwrite=True)
    for rank in (0, 1):
        write_rank(writer, rank)
    assert open_archive(saved).manifest.world.model.dtype == "bfloat16"  # still the old one, still valid
    assert (saved / "manifest.json").read_bytes() == old_manifest
    writer.commit()
    assert open_archive(saved).manifest.world.model.dtype == "float16"
    assert siblings(saved) == []


def test_failed_overwrite_leaves_the_old_archive_intact(saved: Path):
    with pytest.raises(RuntimeError), ArchiveWriter(saved, world(), overwrite=True) as writer:
        write_rank(writer, 0)
        raise RuntimeError("crash")
    open_archive(saved)
    assert siblings(saved) == []


def test_swap_without_rename_exchange_restores_the_old_archive_if_the_second_rename_fails(
    saved: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(archive_write, "_exchange", lambda a, b: False)
    real_rename = os.rename
    calls = []

    def flaky_rename(src, dst):
        calls.append((Path(src).name, Path(dst).name))
        if len(calls) == 2:
            raise OSError("disk on fire")
        real_rename(src, dst)

    writer = ArchiveWriter(saved, world(**{"model.dtype": "float16"}), overwrite=True)
    for rank in (0, 1):
        write_rank(writer, rank)
    monkeypatch.setattr(archive_write.os, "rename", flaky_rename)
    with pytest.raises(OSError, match="disk on fire"):
        writer.commit()
    monkeypatch.setattr(archive_write.os, "rename", real_rename)
    assert calls[0][0] == "archive" and ".trash-" in calls[0][1]
    assert open_archive(saved).manifest.world.model.dtype == "bfloat16"
    assert siblings(saved) == []


def test_swap_without_rename_exchange_works(saved: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(archive_write, "_exchange", lambda a, b: False)
    write_archive(saved, overwrite=True, **{"model.dtype": "float16"})
    assert open_archive(saved).manifest.world.model.dtype == "float16"
    assert siblings(saved) == []


def test_ranks_in_other_processes_join_the_owners_staging_folder(tmp_path: Path):
    root = tmp_path / "a"
    owner = ArchiveWriter(root, world())
    joiner = subprocess.run(
        [sys.executable, "-c", JOIN_SCRIPT, str(root), str(owner.staging)],
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert joiner.returncode == 0, joiner.stderr
    write_rank(owner, 0)
    owner.commit()
    assert open_archive(root).rank_facts(1).pointers.count == 1201


JOIN_SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    sys.path.insert(0, "tests/cpu")
    from archive_fixtures import world, write_rank
    from graphpersist.archive import ArchiveWriter

    with ArchiveWriter(Path(sys.argv[1]), world(), staging=Path(sys.argv[2])) as writer:
        write_rank(writer, 1)
    """
)


# --- kernel images: once per archive, not once per rank

IMAGE = b"\x7fELF a kernel image every rank loads" * 64


def two_rank_archive_sharing(root: Path, image: bytes = IMAGE) -> Path:
    """Rank 0 (the owner) and rank 1 (a writer on its staging folder, as another process would) add one image."""
    with ArchiveWriter(root, world()) as owner:
        other = ArchiveWriter(root, world(), staging=owner.staging)
        write_rank(other, 1, shared_image=image)  # the other rank first: the owner finds the file there
        write_rank(owner, 0, shared_image=image)
        return owner.commit()


def test_an_image_every_rank_loads_is_stored_once(tmp_path: Path) -> None:
    root = two_rank_archive_sharing(tmp_path / "archive")
    sha = hashlib.sha256(IMAGE).hexdigest()
    assert [p.relative_to(root).as_posix() for p in (root / "images").iterdir()] == [f"images/{sha}.bin"]
    archive = open_archive(root)
    files = {r: [i.file for i in archive.rank_facts(r).images if i.sha256 == sha] for r in (0, 1)}
    assert files == {0: [f"images/{sha}.bin"], 1: [f"images/{sha}.bin"]}
    assert archive.manifest.files[f"images/{sha}.bin"].sha256 == sha
    for rank in (0, 1):
        assert open_archive(root, keep_rank=rank).read_path(f"images/{sha}.bin") == IMAGE


def test_a_ranks_load_hashes_the_shared_images_up_front(tmp_path: Path) -> None:
    """A rank's LOAD (keep_rank) hashes its own files and the images; a corrupted image is refused at open."""
    root = two_rank_archive_sharing(tmp_path / "archive")
    path = root / "images" / f"{hashlib.sha256(IMAGE).hexdigest()}.bin"
    path.chmod(0o644)
    path.write_bytes(IMAGE[:-1] + b"!")  # same size: only its hash can tell
    assert "corrupted" in error_of(root, keep_rank=1)


def test_image_bytes_that_do_not_hash_to_the_name_given_are_refused(tmp_path: Path) -> None:
    with ArchiveWriter(tmp_path / "archive", world()) as writer, pytest.raises(ArchiveError, match="hashes to"):
        writer.add_image("ab" * 32, IMAGE)


def test_a_rank_that_aborts_leaves_the_images_to_the_owner(tmp_path: Path) -> None:
    """Only the owner's abort removes the staging folder: another rank's image may be the owner's too."""
    sha = hashlib.sha256(IMAGE).hexdigest()
    with ArchiveWriter(tmp_path / "archive", world()) as owner:
        other = ArchiveWriter(tmp_path / "archive", world(), staging=owner.staging)
        other.add_image(sha, IMAGE)
        other.abort()
        assert (owner.staging / "images" / f"{sha}.bin").read_bytes() == IMAGE


# --- a writer killed mid-way (a real process, SIGKILL: no cleanup code runs)

KILLED_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    sys.path.insert(0, "tests/cpu")
    from archive_fixtures import world, write_rank
    from graphpersist.archive import write as archive_mod
    from graphpersist.archive import ArchiveWriter

    root, where, overwrite = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"

    def hang(*args, **kwargs):
        print("ready", flush=True)
        time.sleep(600)

    if where == "before-publish":
        archive_mod._publish = hang  # manifest.json is written, the rename has not happened
    if where == "between-renames":  # the replace without RENAME_EXCHANGE: old archive moved aside, new not yet in
        archive_mod._exchange = lambda a, b: False
        real_rename = os.rename

        def rename_then_hang(src, dst):
            real_rename(src, dst)
            if ".trash-" in os.fspath(dst):
                hang()

        archive_mod.os.rename = rename_then_hang
    writer = ArchiveWriter(root, world(**{"model.dtype": "float16"}), overwrite=overwrite)
    write_rank(writer, 0)
    if where == "mid-write":
        hang()
    write_rank(writer, 1)
    writer.commit()
    """
)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO / "overlays" / "graphpersist"), "PYTHONDONTWRITEBYTECODE": "1"}


@contextlib.contextmanager
def _writer_paused_at(root: Path, where: str, overwrite: bool) -> Iterator[subprocess.Popen[str]]:
    """A real writer process stopped at `where`; SIGKILLed (no cleanup code runs) when the block ends."""
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_SCRIPT, str(root), where, "1" if overwrite else "0"],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.strip() == "ready", proc.stderr.read()
        yield proc
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()


def _kill_writer_at(root: Path, where: str, overwrite: bool) -> None:
    with _writer_paused_at(root, where, overwrite):
        pass


@pytest.mark.parametrize("where", ["mid-write", "before-publish"])
def test_a_killed_writer_leaves_no_loadable_archive(tmp_path: Path, where: str):
    root = tmp_path / "archive"
    _kill_writer_at(root, where, overwrite=False)
    assert not root.exists()
    [partial] = [tmp_path / name for name in siblings(root)]
    assert ".partial-" in partial.name
    assert (partial / "manifest.json").exists() == (where == "before-publish")
    assert "an unfinished SAVE left" in error_of(root)
    assert remove_stale_partials(root) == [partial]
    assert siblings(root) == []


@pytest.mark.parametrize("where", ["mid-write", "before-publish"])
def test_a_killed_overwrite_leaves_the_old_archive_whole(saved: Path, where: str):
    _kill_writer_at(saved, where, overwrite=True)
    assert open_archive(saved).manifest.world.model.dtype == "bfloat16"


def test_the_next_writer_clears_what_a_dead_one_left(tmp_path: Path):
    root = tmp_path / "archive"
    _kill_writer_at(root, "mid-write", overwrite=False)
    write_archive(root)
    open_archive(root)
    assert siblings(root) == []


def test_missing_parent_folders_are_created(tmp_path: Path):
    root = write_archive(tmp_path / "deep" / "er" / "archive")
    assert open_archive(root).ranks == (0, 1)


# --- a replace killed between its two renames (no RENAME_EXCHANGE): the old archive is kept and named


def test_a_replace_stopped_between_its_renames_names_the_previous_archive_and_keeps_it(saved: Path):
    with _writer_paused_at(saved, "between-renames", overwrite=True) as proc:
        assert not saved.exists()
        live = error_of(saved).splitlines()
        assert live[0].startswith(
            f"graphpersist: cannot open archive {saved}: no such directory: a SAVE (pid {proc.pid})"
        )
        assert live[1] == "Try again when that SAVE has finished."
        assert remove_stale_partials(saved) == [], "a running writer's folders are never touched"
    [trash] = [name for name in siblings(saved) if ".trash-" in name]
    [partial] = [name for name in siblings(saved) if ".partial-" in name]
    assert error_of(saved).splitlines() == [
        f"graphpersist: cannot open archive {saved}: no such directory: a SAVE that was replacing it stopped "
        f"between its two renames; the previous archive is whole in {trash}",
        f"To load it, rename it back: mv '{saved.parent / trash}' '{saved}'",
    ]
    # the dead writer's staging folder goes; its trash, the only whole archive, stays while the archive is missing
    assert remove_stale_partials(saved) == [saved.parent / partial]
    assert siblings(saved) == [trash]
    with pytest.raises(ArchiveError, match=rf"it is missing, but the previous archive is in {re.escape(trash)}"):
        ArchiveWriter(saved, world())
    os.rename(saved.parent / trash, saved)
    assert open_archive(saved).manifest.world.model.dtype == "bfloat16"


def test_a_new_save_over_a_stopped_replace_publishes_and_then_clears_the_old_archive(saved: Path):
    _kill_writer_at(saved, "between-renames", overwrite=True)
    assert any(".trash-" in name for name in siblings(saved))
    write_archive(saved, overwrite=True, **{"model.dtype": "float32"})
    assert open_archive(saved).manifest.world.model.dtype == "float32"
    assert siblings(saved) == []


# --- whose staging folder is it: pid and process start time, so a reused pid does not keep garbage alive


def _own_start_time() -> int:
    stat = Path("/proc/self/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_staging_folders_are_named_after_the_writer_pid_and_start_time(tmp_path: Path):
    with ArchiveWriter(tmp_path / "a", world()) as writer:
        pid, start, scope, _random = writer.staging.name.removeprefix("a.partial-").split("-")
        assert (int(pid), int(start)) == (os.getpid(), _own_start_time())
        assert re.fullmatch(r"[0-9a-f]{8}", scope) and scope == archive_side._scope()


def test_a_folder_whose_pid_now_belongs_to_another_process_is_stale(tmp_path: Path):
    """Our own pid with another start time: the writer died and the pid was reused (here: by this test)."""
    root = tmp_path / "a"
    scope, me, start = archive_side._scope(), os.getpid(), _own_start_time()
    reused = tmp_path / f"a.partial-{me}-{start + 1}-{scope}-00000001"
    mine = tmp_path / f"a.partial-{me}-{start}-{scope}-00000002"
    for path in (reused, mine):
        path.mkdir()
    assert remove_stale_partials(root) == [reused]
    assert mine.exists(), "a folder of a running writer (same pid, same start time) is never removed"


def test_folders_from_another_boot_or_namespace_are_never_judged(tmp_path: Path):
    """Its pid means nothing here: even a pid that is free here may be a live writer elsewhere."""
    other_scope = "00000000" if archive_side._scope() != "00000000" else "11111111"
    foreign = tmp_path / f"a.partial-{_dead_pid()}-12345-{other_scope}-00000001"
    foreign.mkdir()
    assert remove_stale_partials(tmp_path / "a") == []
    assert foreign.exists()


def test_old_style_names_are_still_judged_by_pid(tmp_path: Path):
    root = write_archive(tmp_path / "a")  # the root exists: a dead writer's trash folder may go too
    dead = [tmp_path / f"a.partial-{_dead_pid()}-0badc0de", tmp_path / f"a.trash-{_dead_pid()}-12345678"]
    alive = tmp_path / f"a.trash-{os.getpid()}-12345678"
    for path in (*dead, alive):
        path.mkdir()
    assert sorted(remove_stale_partials(root)) == sorted(dead)
    assert siblings(root) == [alive.name]


def test_an_old_style_trash_folder_is_named_when_the_archive_is_missing(tmp_path: Path):
    root = write_archive(tmp_path / "old")
    trash = tmp_path / f"archive.trash-{_dead_pid()}-0badc0de"
    os.rename(root, trash)
    message = error_of(tmp_path / "archive")
    assert f"the previous archive is whole in {trash.name}" in message
    assert remove_stale_partials(tmp_path / "archive") == []


def test_the_writer_refuses_what_the_reader_would(tmp_path: Path):
    writer = ArchiveWriter(tmp_path / "empty", world(**{"parallel.world_size": 0}))
    with pytest.raises(ArchiveError, match=r"parallel\.world_size is 0: it must be at least 1"):
        writer.commit()
    assert not (tmp_path / "empty").exists()


def test_keep_rank_verifies_its_own_files_and_leaves_the_other_ranks_to_theirs(tmp_path: Path) -> None:
    """A rank's LOAD (keep_rank) hashes its own payload, the shared files and every rank record, not the other
    ranks' payloads: those are checked for presence and size here, and hashed by their own rank or when read."""
    root = write_archive(tmp_path / "a")
    log = root / "rank_1" / "allocations.log"
    data = bytearray(log.read_bytes())
    data[0] ^= 0xFF  # rank 1's payload corrupted, same size
    log.write_bytes(bytes(data))
    archive = open_archive(root, keep_rank=0)  # rank 0 does not hash rank 1's payload
    with pytest.raises(ArchiveError, match=r"corrupted file rank_1/allocations\.log"):
        archive.read(1, "allocations.log")  # read anyway: verified
    with pytest.raises(ArchiveError, match=r"corrupted file rank_1/allocations\.log"):
        open_archive(root, keep_rank=1)  # rank 1's own LOAD refuses
    with pytest.raises(ArchiveError, match=r"corrupted file rank_1/allocations\.log"):
        open_archive(root)  # and so do inspect and check (every file)
    log.write_bytes(bytes(data[:-1]))  # a truncation is caught by every rank (size)
    with pytest.raises(ArchiveError, match=r"rank_1/allocations\.log"):
        open_archive(root, keep_rank=0)
    record = root / "rank_1" / "rank.json"
    log.write_bytes(bytes(data[:0]) + bytes([data[0] ^ 0xFF]) + bytes(data[1:]))  # repaired
    text = bytearray(record.read_bytes())
    text[-2] ^= 0x01  # a rank record is always hashed, whichever rank opens
    record.write_bytes(bytes(text))
    with pytest.raises(ArchiveError, match=r"rank_1/rank\.json"):
        open_archive(root, keep_rank=0)
