"""Small, deterministic archives for the CPU tests and the README's examples.

The payload bytes are stand-ins (no GPU here), but the structure is the real one: world facts, per-rank
records whose graphs and images point at files that exist, and every file in the manifest's table.
Run it to make one (write_loadable_archive: what SAVE writes, so `graphpersist check` verifies it as LOAD reads it):
`PYTHONPATH=overlays/graphpersist python tests/cpu/archive_fixtures.py /tmp/demo-archive`.
"""

from __future__ import annotations

import copy
import hashlib
import json
import stat
import struct
import sys
from pathlib import Path
from typing import Any

from graphpersist.archive import ArchiveWriter, archive_path, codec
from graphpersist.archive.liveenv import PINNED_ENV, set_field
from graphpersist.archive.manifest import FORMAT_VERSION, RANK_DIR, ManifestError, RankRecord
from graphpersist.graph import format as graphformat
from graphpersist.graph import pack as graphpack
from graphpersist.graph.format import MEMCPY_FIELDS

REGION_BASE = 0x7E0000000000
REGION_SIZE = 64 << 30
CAPTURE_SIZES = (1, 2, 4, 8)
# The GPUs of an 8-GPU host in PCI order (UUIDs as nvidia-smi prints them, PCI ids as sysfs does); rank r saved on
# GPU r. A 2-rank archive uses the first two, so every rank of any world up to 8 has a GPU of its own.
GPU_UUIDS = (
    "GPU-11111111-2222-3333-4444-555555555555",
    "GPU-66666666-7777-8888-9999-aaaaaaaaaaaa",
    "GPU-22222222-3333-4444-5555-666666666602",
    "GPU-33333333-4444-5555-6666-777777777703",
    "GPU-44444444-5555-6666-7777-888888888804",
    "GPU-55555555-6666-7777-8888-999999999905",
    "GPU-77777777-8888-9999-aaaa-bbbbbbbbbb06",
    "GPU-88888888-9999-aaaa-bbbb-cccccccccc07",
)
PCI_BUS_IDS = (
    "0000:19:00.0",
    "0000:3a:00.0",
    "0000:4c:00.0",
    "0000:5d:00.0",
    "0000:9b:00.0",
    "0000:bb:00.0",
    "0000:cb:00.0",
    "0000:db:00.0",
)


def device(rank: int) -> dict[str, Any]:
    """rank.json's `device` for a rank of the fixture archive: device index = rank, one GPU each."""
    return {"index": rank, "uuid": GPU_UUIDS[rank], "pci_bus_id": PCI_BUS_IDS[rank]}


def world(**changes: Any) -> dict[str, Any]:
    """World facts of a plausible TP=2 vLLM SAVE; `changes` use dotted names ("parallel.tp_size": 4)."""
    facts: dict[str, Any] = {
        "engine": {"name": "vllm", "version": "0.26.0+gp.1", "commit": "0123456789abcdef0123456789abcdef01234567"},
        "distribution": {"version": "1"},
        "torch": {"version": "2.9.0+cu128"},
        "cuda": {"runtime": "12.8", "driver": "570.133.20", "driver_api": "12.8"},
        "nccl": {"version": "2.27.3"},
        "gpu": {"model": "NVIDIA H200", "compute_capability": "9.0"},
        "parallel": {"world_size": 2, "tp_size": 2, "pp_size": 1, "ep_size": 1},
        "model": {"dtype": "bfloat16", "config_fingerprint": "sha256:" + "ab" * 32},
        "capture": {"sizes": list(CAPTURE_SIZES), "modes": ["full"]},
        "env": {name: None for name in PINNED_ENV} | {"NCCL_NVLS_ENABLE": "0", "NCCL_CUMEM_ENABLE": "1"},
        "flags": {"enforce_eager": False},
    }
    for dotted, value in changes.items():
        set_field(facts, dotted, value)
    return facts


def smi_rows(gpus: int = 2) -> list[dict[str, str]]:
    """nvidia-smi's rows for the fixture's first `gpus` GPUs, spelled as nvidia-smi spells them (8-digit PCI
    domain, upper-case hex), in PCI order like the real one: what `liveenv._smi_gpus()` returns on that host."""
    return [
        {
            "index": str(i),
            "uuid": GPU_UUIDS[i],
            "name": "NVIDIA H200",
            "driver_version": "580.159.04",
            "pci.bus_id": "0000" + PCI_BUS_IDS[i].upper(),
            "compute_cap": "9.0",
        }
        for i in range(gpus)
    ]


def fake_nvidia_smi(folder: Path, gpus: int = 2) -> Path:
    """Writes an `nvidia-smi` into `folder` that lists the fixture's first `gpus` GPUs (put `folder` first on PATH).

    It answers graphpersist's --query-gpu=... --format=csv,noheader with the fields asked for (smi_rows).
    """
    rows = smi_rows(gpus)
    script = folder / "nvidia-smi"
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"rows = {rows!r}\n"
        "query = next(a for a in sys.argv[1:] if a.startswith('--query-gpu='))\n"
        "fields = query.split('=', 1)[1].split(',')\n"
        "for row in rows:\n"
        "    print(', '.join(row[f] for f in fields))\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def _blob(*parts: object) -> bytes:
    seed = "/".join(str(p) for p in parts).encode()
    return b"".join(hashlib.sha256(seed + bytes([i])).digest() for i in range(32))


def write_rank(
    writer: ArchiveWriter,
    rank: int,
    gpu: dict[str, Any] | int | None = None,
    extra: dict[str, Any] | None = None,
    shared_image: bytes | None = None,
) -> dict[str, Any]:
    """Writes one rank's payload (two kernel images, one graph per capture size) and its record.

    `gpu` is the record's `device`: default device(rank); a bare device index makes the writer look the GPU up
    (what SAVE does in a rank's process). `extra`: the record's free-form part (SAVE's engine notes go there).
    `shared_image`: one more image, added as SAVE adds them (`add_image`: once per archive, whichever ranks list it).
    """
    images = []
    for kind in ("cubin", "fatbin"):
        data = _blob("image", kind, rank)
        sha = hashlib.sha256(data).hexdigest()
        path = writer.add_file(rank, f"images/{sha}.{kind}", data)
        entries = [f"kernel_{kind}_{i}" for i in range(3)]
        images.append({"sha256": sha, "file": path, "size": len(data), "kind": kind, "entries": entries})
    if shared_image is not None:
        sha = hashlib.sha256(shared_image).hexdigest()
        path = writer.add_image(sha, shared_image)
        images.append({"sha256": sha, "file": path, "size": len(shared_image), "kind": "cubin", "entries": ["k"]})
    graphs = []
    for size in CAPTURE_SIZES:
        nodes = [{"type": "kernel", "image": images[i % 2]["sha256"]} for i in range(4 + size)]
        nodes.append({"type": "memcpy"})
        path = writer.add_json(rank, f"graphs/bs{size}.json", {"nodes": nodes})
        topology = hashlib.sha256(f"topology-{size}".encode()).hexdigest()
        graphs.append(
            {
                "name": f"full-bs{size}",
                "file": path,
                "topology_fingerprint": topology,
                "node_count": len(nodes),
                "nodes_by_type": {"kernel": len(nodes) - 1, "memcpy": 1},
                "kernel_count": 3,
                "images": [image["sha256"] for image in images],
                "capture_size": size,
                "mode": "full",
            }
        )
    writer.add_file(rank, "allocations.log", _blob("allocations", rank))
    facts = {
        "device": device(rank) if gpu is None else gpu,
        "region": {"base": REGION_BASE, "size": REGION_SIZE, "final_offset": (3 << 30) + rank * 4096},
        "pointers": {"fingerprint": hashlib.sha256(f"pointers-{rank}".encode()).hexdigest(), "count": 1200 + rank},
        "graphs": graphs,
        "images": images,
    }
    if extra is not None:
        facts["extra"] = extra
    writer.set_rank_facts(rank, facts)
    return facts


def write_archive(root: Path, *, overwrite: bool = False, **world_changes: Any) -> Path:
    """A complete archive at `root` for world(**world_changes), one rank per parallel.world_size."""
    facts = world(**world_changes)
    with ArchiveWriter(root, facts, overwrite=overwrite) as writer:
        writer.add_json(None, "engine.json", {"kv_cache_blocks": 4096})
        for rank in range(facts["parallel"]["world_size"]):
            write_rank(writer, rank)
        return writer.commit()


def _retable(root: Path, rels: list[str]) -> None:
    manifest = json.loads((root / "manifest.json").read_bytes())
    for rel in rels:
        data = (root / rel).read_bytes()
        manifest["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2))


def redigest(doc: Any) -> Any:
    """A rank record's JSON with extra.digests.record recomputed (as the writer computes it); as it is when it has no
    digests or is not a record the reader would parse."""
    try:
        from graphpersist.archive import digests as archive_digests
    except ImportError:  # a release before the records' commitments
        return doc
    extra = doc.get("extra") if isinstance(doc, dict) else None  # a mutated record's extra may be any JSON
    digests = extra.get(archive_digests.KEY) if isinstance(extra, dict) else None
    if not isinstance(digests, dict):
        return doc
    try:
        record = codec.to_dict(codec.from_dict(RankRecord, doc))
    except (ManifestError, TypeError, RecursionError):  # the reader refuses it before any digest is compared
        return doc
    digests["record"] = archive_digests.record_digest(record)
    return doc


def forge(root: Path, rel: str, data: bytes) -> None:
    """Replaces listed file `rel` (or manifest.json) by `data` as a forger would: the rank record that commits to it
    (its extra.digests, then its own digest) and the file table made to match, so that the bytes reach the reader
    that parses them. What a test of that reader needs; what no archive damage or careless edit can do."""
    (root / rel).write_bytes(data)
    changed = [rel]
    try:
        from graphpersist.archive import digests as archive_digests
    except ImportError:  # a release before the records' commitments: the table is all there is to match
        _retable(root, changed)
        return
    if rel == "manifest.json":
        _forge_manifest(root, data)
        return
    top = rel.split("/", 1)[0]
    owner = int(top.removeprefix("rank_")) if RANK_DIR.fullmatch(top) else 0
    record_rel = f"rank_{owner}/rank.json"
    if rel == record_rel:
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError):  # hostile text: the parser's business, nothing to match
            doc = None
        if isinstance(doc, dict):
            (root / rel).write_text(json.dumps(redigest(doc), indent=2))
    elif archive_digests.owned(rel, owner) and (root / record_rel).is_file():
        doc = json.loads((root / record_rel).read_bytes())
        digests = doc.get("extra", {}).get(archive_digests.KEY)
        if isinstance(digests, dict):
            digests["files"][rel] = hashlib.sha256(data).hexdigest()
            (root / record_rel).write_text(json.dumps(redigest(doc), indent=2))
            changed.append(record_rel)
    _retable(root, changed)


def _forge_manifest(root: Path, data: bytes) -> None:
    """manifest.json replaced by `data`, rank 0's commitment to it (and rank 0's table entry) made to match, where
    `data` is a manifest the reader would parse that far."""
    from graphpersist.archive import digests as archive_digests

    record_rel = "rank_0/rank.json"
    try:
        doc = json.loads(data)
        record = json.loads((root / record_rel).read_bytes())
        record["extra"][archive_digests.KEY]["manifest"] = archive_digests.manifest_digest(doc)
        listed = record_rel in doc["files"]
    except (ValueError, RecursionError, TypeError, KeyError, AttributeError):  # the parser's business
        return
    if not listed:
        return
    (root / record_rel).write_text(json.dumps(redigest(record), indent=2))
    _retable(root, [record_rel])


def live_for(rank: int = 0, **changes: Any) -> dict[str, Any]:
    """Live facts (as collect_live nests them) that match write_archive()'s archive, with `changes` applied."""
    live = copy.deepcopy(world())
    live["format_version"] = FORMAT_VERSION
    live["parallel"]["rank"] = rank
    live["device"] = device(rank)
    live["region"] = {"base": REGION_BASE, "size": REGION_SIZE}
    for dotted, value in changes.items():
        set_field(live, dotted, value)
    return live


# ------------------------------------------------------------------------------------------ loadable archives
# write_rank's payload is a stand-in (structure only). write_loadable_rank writes what SAVE writes
# (save.Saver._write): a graph pack and its index, the allocation log, the phases, the pointer inventory, the setup
# tensors, declared state, torch's blocks and engine notes, so that everything LOAD reads on CPU
# (graphpersist.loadplan) and `graphpersist check` verifies is there and consistent. The graphs keep write_rank's
# names and node counts; their nodes are kernels, a memcpy, a memset and an event pair, as graphwalk writes them.

GRANULARITY = 2 << 20


def _kernel_node(i: int, func: int, sha: str, name: str, offset: int, params: bytes) -> dict[str, Any]:
    return {"type": "kernel", "func": func, "image": sha, "name": name, "grid": [1 + i, 1, 1], "block": [128, 1, 1],
            "smem": 0, "layout": [[0, 8], [8, 8]], "params": [offset, len(params)],
            "attrs": {"1": "01"} if i % 3 == 0 else {}}  # fmt: skip


def loadable_graph(size: int, rank: int, funcs: list[list[Any]], buffers: list[int]) -> tuple[dict, bytes, bytes]:
    """A graph as graphwalk.serialize describes it: 5 + size nodes (kernels reading `buffers`, a memcpy between two
    of them; at batch 8 also a memset and an event record/wait pair), its parameter blob and kernel table."""
    nodes: list[dict[str, Any]] = []
    blob = bytearray()
    n_nodes = 5 + size
    others = {n_nodes - 1: "memcpy"} | ({1: "memset", 2: "event_record", 3: "event_wait"} if size == 8 else {})
    for i in range(n_nodes):
        kind = others.get(i, "kernel")
        if kind == "kernel":
            func = i % len(funcs)
            params = struct.pack("<QQ", buffers[i % len(buffers)] + 64 * i, 1000 * rank + size)
            nodes.append(_kernel_node(i, func, funcs[func][0], funcs[func][1], len(blob), params))
            blob += params
        elif kind == "memcpy":
            fields = dict.fromkeys(MEMCPY_FIELDS, 0) | {"srcDevice": buffers[0], "dstDevice": buffers[1],
                                                        "WidthInBytes": 256, "Height": 1, "Depth": 1}  # fmt: skip
            nodes.append({"type": "memcpy", "srcMemoryType": 2, "dstMemoryType": 2, **fields})
        elif kind == "memset":
            nodes.append({"type": "memset", "dst": buffers[2], "pitch": 0, "value": 0, "elementSize": 4,
                          "width": 64, "height": 1})  # fmt: skip
        else:
            nodes.append({"type": kind, "event": 0})
    desc: dict[str, Any] = {
        "format": 1,
        "nodes": nodes,
        "edges": [[i, i + 1, 0, 0, 0] for i in range(n_nodes - 1)],
        "funcs": funcs,
        "blob_size": len(blob),
        "blob_sha256": hashlib.sha256(blob).hexdigest(),
    }
    if size == 8:
        desc["events"] = [{"flags": 2}]
    table = graphformat.pack_kernel_table(desc)
    desc["table_size"], desc["table_sha256"] = len(table), hashlib.sha256(table).hexdigest()
    return desc, bytes(blob), table


def write_loadable_rank(writer: ArchiveWriter, rank: int, shared_image: bytes = b"kernels every rank loads") -> None:
    """One rank as SAVE writes it (see above), its region at REGION_BASE, its GPU device(rank)."""
    own_image = _blob("image", "cubin", rank)
    images = []
    for data, entries in ((own_image, ["k_own"]), (shared_image, ["k_shared"])):
        sha = hashlib.sha256(data).hexdigest()
        images.append({"sha256": sha, "file": writer.add_image(sha, data), "size": len(data), "kind": "cubin",
                       "entries": entries})  # fmt: skip
    funcs = [[images[0]["sha256"], "k_own", {}], [images[1]["sha256"], "k_shared", {"8": 65536}]]
    mib = 1 << 20
    # The allocation log: setup (weights, KV cache), capture, a post-capture registration.
    log = [
        ["alloc", REGION_BASE, 64 * mib, 64 * mib],
        ["alloc", REGION_BASE + 64 * mib, 32 * mib, 30 * mib],
        ["alloc", REGION_BASE + 96 * mib, 8 * mib, 8 * mib],
        ["alloc", REGION_BASE + 104 * mib, 2 * mib, 4096],
    ]
    buffers = [REGION_BASE + 4096, REGION_BASE + 64 * mib + 512, REGION_BASE + 96 * mib]  # fmt: skip
    ph = [
        {"name": "(setup)", "implicit": True, "start_event": 0, "end_event": 1, "start": 0, "end": 64 * mib,
         "limit": 64 * mib},
        {"name": "kv_cache", "start_event": 1, "end_event": 2, "start": 64 * mib, "end": 96 * mib,
         "limit": 96 * mib},
        {"name": "custom_all_reduce", "post_capture": True, "start_event": 3, "end_event": 4, "start": 104 * mib,
         "end": 106 * mib, "limit": 106 * mib},
    ]  # fmt: skip
    pack = graphpack.PackWriter()
    records = []
    pointers: set[int] = set()
    spec = {"addr": buffers[1], "dtype": "bfloat16", "shape": [8, 64], "stride": [64, 1]}
    index_rel = archive_path(rank, graphpack.INDEX_NAME)
    for size in CAPTURE_SIZES:
        desc, blob, table = loadable_graph(size, rank, funcs, buffers)
        name = f"full-bs{size}"
        outputs = {"kind": "tuple", "items": [{"kind": "tensor", "spec": spec}, {"kind": "value", "value": None}]}
        pack.add(name, desc, blob, table, inputs=[spec], outputs=outputs)
        by_type = graphformat.node_types(desc)
        records.append({"name": name, "file": index_rel, "topology_fingerprint": graphformat.topology_fingerprint(desc),
                        "node_count": len(desc["nodes"]), "nodes_by_type": by_type,
                        "kernel_count": by_type.get("kernel", 0), "images": sorted(im["sha256"] for im in images),
                        "capture_size": size, "mode": "full", "instantiate_flags": 1})  # fmt: skip
        pointers |= {w for (w,) in struct.iter_unpack("<Q", blob) if REGION_BASE <= w < REGION_BASE + REGION_SIZE}
        pointers |= {buffers[0], buffers[1]} | ({buffers[2]} if size == 8 else set())
    inventory = sorted(pointers)
    state_bytes = _blob("rank data", rank)[:256]
    writer.add_json(rank, "alloc_log.json", log)
    writer.add_json(rank, "pointers.json", inventory)
    writer.add_json(rank, "setup_tensors.json", [["model.weight", REGION_BASE + 4096, "bfloat16", [1024, 64], [64, 1]]])
    writer.add_file(rank, "state/0.bin", state_bytes)
    writer.add_file(rank, graphpack.PACK_NAME, pack.data())
    writer.add_json(rank, graphpack.INDEX_NAME, pack.index())
    writer.set_rank_facts(rank, {
        "device": device(rank),
        "region": {"base": REGION_BASE, "size": REGION_SIZE, "final_offset": 106 * mib},
        "pointers": {"fingerprint": hashlib.sha256(json.dumps(inventory).encode()).hexdigest(),
                     "count": len(inventory)},
        "graphs": records,
        "images": images,
        "extra": {
            "setup_events": 2, "setup_cursor": 96 * mib, "granularity": GRANULARITY, "phases": ph,
            "state": [{"name": "rank_data", "addr": REGION_BASE + 104 * mib, "nbytes": len(state_bytes),
                       "how": "bytes", "sha256": hashlib.sha256(state_bytes).hexdigest(), "phase": "custom_all_reduce",
                       "file": "state/0.bin"},
                      {"name": "peer_ptrs", "addr": REGION_BASE + 104 * mib + 4096, "nbytes": 64,
                       "how": "recreated", "sha256": "cd" * 32, "phase": "custom_all_reduce", "file": None}],
            "torch_blocks": [[REGION_BASE + 4096, 1 << 20]],
            "engine_notes": {"dispatch": {"full-bs8": [8, 8, True]}, "kernel_choices": {}},
            "pointer_phases": {"(setup)": 2, "kv_cache": 1},
        },
    })  # fmt: skip


def write_loadable_archive(
    root: Path, *, overwrite: bool = False, shared_image: bytes = b"kernels every rank loads", **world_changes: Any
) -> Path:
    """A complete archive for world(**world_changes) as SAVE writes it: write_loadable_rank for every rank and the
    shared files rank 0 adds first (engine.json, jitcache.tar). Another `shared_image` makes other payload bytes."""
    facts = world(**world_changes)
    with ArchiveWriter(root, facts, overwrite=overwrite) as writer:
        writer.add_shared({"engine.json": b'{"kv_cache_blocks": 4096}\n', "jitcache.tar": b"\0" * 1024})
        for rank in range(facts["parallel"]["world_size"]):
            write_loadable_rank(writer, rank, shared_image)
        return writer.commit()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: archive_fixtures.py OUT_DIR")
    print(write_loadable_archive(Path(sys.argv[1])))  # what `graphpersist inspect|check|diff` read, as SAVE writes it
