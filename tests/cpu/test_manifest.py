"""The manifest and per-rank records survive JSON unchanged, and anything unexpected is refused."""

from __future__ import annotations

import json

import pytest
from archive_fixtures import world

from graphpersist.archive import codec
from graphpersist.archive.manifest import (
    FORMAT_VERSION,
    Creation,
    DeviceFacts,
    FileEntry,
    GraphRecord,
    ImageRecord,
    Manifest,
    ManifestError,
    PointerInventory,
    RankExtra,
    RankRecord,
    RegionFacts,
    UnsupportedFormat,
    World,
    rank_dir,
)


def a_manifest() -> Manifest:
    return Manifest(
        format_version=FORMAT_VERSION,
        created=Creation(created_at="2026-01-01T00:00:00+00:00", host="h", graphpersist_version="1", python="3.12"),
        world=codec.from_dict(World, world()),
        ranks=(0, 1),
        files={"rank_0/rank.json": FileEntry("aa" * 32, 10), "rank_1/rank.json": FileEntry("bb" * 32, 11)},
    )


def a_rank_record() -> RankRecord:
    image = ImageRecord(sha256="cd" * 32, file="rank_0/images/x.cubin", size=4, kind="cubin", entries=("k0", "k1"))
    graph = GraphRecord(
        name="full-bs8",
        file="rank_0/graphs/bs8.json",
        topology_fingerprint="ef" * 32,
        node_count=13,
        nodes_by_type={"kernel": 12, "memcpy": 1},
        kernel_count=2,
        images=(image.sha256,),
        capture_size=8,
        mode="full",
        instantiate_flags=0x9,
    )
    return RankRecord(
        rank=0,
        device=DeviceFacts(index=0, uuid="GPU-11111111-2222-3333-4444-555555555555", pci_bus_id="0000:19:00.0"),
        region=RegionFacts(base=0x7E0000000000, size=1 << 36, final_offset=1 << 30),
        pointers=PointerInventory(fingerprint="01" * 32, count=7),
        graphs=(graph,),
        images=(image,),
        extra=RankExtra(setup_events=1, setup_cursor=4096, engine_notes={"note": ["anything", 1]}),
    )


def test_manifest_round_trips_through_json():
    manifest = a_manifest()
    text = codec.to_json(manifest)
    assert codec.from_json(Manifest, text) == manifest
    assert json.loads(text)["format"] == "graphpersist-archive"
    assert json.loads(text)["format_version"] == FORMAT_VERSION


def test_rank_record_round_trips_through_json():
    record = a_rank_record()
    assert codec.from_json(RankRecord, codec.to_json(record)) == record
    assert codec.from_dict(RankRecord, json.loads(codec.to_json(record))) == record


def test_a_graph_record_without_instantiate_flags_reads_as_flags_0():
    """Archives written before the field instantiated their graphs with flags 0 at LOAD: they still read so."""
    data = json.loads(codec.to_json(a_rank_record()))
    assert data["graphs"][0]["instantiate_flags"] == 0x9
    del data["graphs"][0]["instantiate_flags"]
    assert codec.from_dict(RankRecord, data).graphs[0].instantiate_flags == 0


def test_world_round_trips_and_keeps_unset_pins():
    facts = world()
    parsed = codec.from_dict(World, facts)
    assert codec.to_dict(parsed) == facts
    assert parsed.env["NCCL_ALGO"] is None
    assert parsed.env["NCCL_NVLS_ENABLE"] == "0"
    assert parsed.capture.sizes == (1, 2, 4, 8)


def test_unknown_future_format_version_is_refused_with_a_clear_message():
    data = codec.to_dict(a_manifest()) | {"format_version": FORMAT_VERSION + 1}
    with pytest.raises(UnsupportedFormat, match=rf"format version {FORMAT_VERSION + 1} is newer than"):
        codec.from_dict(Manifest, data)


def test_an_older_format_is_refused_as_older_so_the_reader_can_advise_a_new_save():
    data = codec.to_dict(a_manifest()) | {"format_version": FORMAT_VERSION - 1}
    with pytest.raises(UnsupportedFormat, match=rf"format version {FORMAT_VERSION - 1} is older than") as info:
        codec.from_dict(Manifest, data)
    assert info.value.older is True and info.value.version == FORMAT_VERSION - 1
    with pytest.raises(UnsupportedFormat) as newer:
        codec.from_dict(Manifest, codec.to_dict(a_manifest()) | {"format_version": FORMAT_VERSION + 1})
    assert newer.value.older is False


def test_a_format_1_rank_record_with_a_bare_device_index_is_refused():
    """Format 2 records which physical GPU each rank used; a bare index cannot be compared with a live GPU."""
    data = json.loads(codec.to_json(a_rank_record())) | {"device": 0}
    with pytest.raises(ManifestError, match=r"rank\.device must be an object, got int"):
        codec.from_dict(RankRecord, data)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"uuid": None}, r"rank\.device\.uuid must be a str"),
        ({"pci_bus_id": 25}, r"rank\.device\.pci_bus_id must be a str"),
        ({"index": "0"}, r"rank\.device\.index must be an integer"),
    ],
)
def test_the_rank_gpu_must_be_fully_named(change, message):
    data = json.loads(codec.to_json(a_rank_record()))
    data["device"] |= change
    with pytest.raises(ManifestError, match=message):
        codec.from_dict(RankRecord, data)


def test_a_rank_gpu_without_its_pci_bus_id_is_refused():
    data = json.loads(codec.to_json(a_rank_record()))
    del data["device"]["pci_bus_id"]
    with pytest.raises(ManifestError, match=r"rank\.device\.pci_bus_id is missing"):
        codec.from_dict(RankRecord, data)


def test_unknown_version_is_refused_before_the_rest_is_read():
    """A future format may change every field; the version alone must decide."""
    with pytest.raises(UnsupportedFormat):
        codec.from_dict(Manifest, {"format": "graphpersist-archive", "format_version": 99, "whatever": 1})


def test_other_formats_are_not_manifests():
    with pytest.raises(ManifestError, match="not a graphpersist manifest"):
        codec.from_dict(Manifest, codec.to_dict(a_manifest()) | {"format": "something-else"})
    with pytest.raises(ManifestError, match="format_version must be a positive integer"):
        codec.from_dict(Manifest, codec.to_dict(a_manifest()) | {"format_version": "1"})


def test_garbled_json_is_a_manifest_error():
    with pytest.raises(ManifestError, match=r"manifest\.json is not valid JSON"):
        codec.from_json(Manifest, '{"format": ')


def test_missing_field_is_named():
    data = codec.to_dict(a_manifest())
    del data["world"]["parallel"]["tp_size"]
    with pytest.raises(ManifestError, match=r"manifest\.world\.parallel\.tp_size is missing"):
        codec.from_dict(Manifest, data)


def test_unknown_field_is_refused():
    data = codec.to_dict(a_manifest())
    data["world"]["gpu"]["memory"] = "141GB"
    with pytest.raises(ManifestError, match=r"manifest\.world\.gpu: unknown field\(s\) memory"):
        codec.from_dict(Manifest, data)


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("world", "parallel", "tp_size"), "2", r"world\.parallel\.tp_size must be an integer"),
        (("world", "parallel", "tp_size"), True, r"world\.parallel\.tp_size must be an integer"),
        (("world", "capture", "sizes"), 8, r"world\.capture\.sizes must be a list"),
        (("world", "engine", "name"), None, r"world\.engine\.name must be a str"),
        (("files",), [], r"manifest\.files must be an object"),
    ],
)
def test_mistyped_fields_are_refused(path, value, message):
    data = codec.to_dict(a_manifest())
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(ManifestError, match=message):
        codec.from_dict(Manifest, data)


def test_rank_record_defaults_are_empty_and_rank_dir_is_stable():
    record = codec.from_dict(
        RankRecord,
        {
            "rank": 3,
            "device": {"index": 1, "uuid": "GPU-x", "pci_bus_id": "0000:3a:00.0"},
            "region": {"base": 1, "size": 2, "final_offset": 0},
            "pointers": {"fingerprint": "x", "count": 0},
        },
    )
    assert record.graphs == () and record.images == () and record.extra == RankExtra()
    assert record.device == DeviceFacts(index=1, uuid="GPU-x", pci_bus_id="0000:3a:00.0")
    assert rank_dir(3) == "rank_3"


def test_creation_now_records_who_wrote_it():
    created = Creation.now()
    assert created.created_at.endswith("+00:00")
    assert created.host and created.graphpersist_version and created.python
