"""Small, deterministic archives for the CPU tests and the README's examples.

The payload bytes are stand-ins (no GPU here), but the structure is the real one: world facts, per-rank
records whose graphs and images point at files that exist, and every file in the manifest's table.
Run it to make one: `PYTHONPATH=overlays/graphpersist python tests/cpu/archive_fixtures.py /tmp/demo-archive`.
"""

from __future__ import annotations

import copy
import hashlib
import stat
import sys
from pathlib import Path
from typing import Any

from graphpersist.archive import ArchiveWriter
from graphpersist.archive.liveenv import PINNED_ENV, set_field
from graphpersist.archive.manifest import FORMAT_VERSION

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


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: archive_fixtures.py OUT_DIR")
    print(write_archive(Path(sys.argv[1])))
