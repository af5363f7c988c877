"""Diagnosis: do the kernels a graph captured read module globals that their library set at run time?

LOAD loads each kernel image again as a fresh module, whose globals (`__device__`/`__constant__` variables) start
from the image's initial values; a library that wrote into its own copy's globals before launching (through
cuModuleGetGlobal and a copy) leaves LOAD's copy different. This script, run on the GPU host under the interposer,
captures one bf16 matmul of Qwen3-8B's o_proj shape ([8, 4096] x [4096, 4096], where cuBLAS picks split-K
kernels), lists every object symbol of each image the graph's kernels come from, and compares its bytes in the
library's own module with a freshly loaded copy of the same image.

    python3 recipes/runtime-single-gpu/globals_probe.py [--m 8] [--k 4096] [--n 4096] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import struct
import sys
from pathlib import Path
from typing import Any

from matmulgraph import arguments, capture


def elf_objects(image: bytes) -> list[str]:
    """Names of the STT_OBJECT symbols of every uncompressed ELF64 cubin in an image (a cubin, or a fatbin that
    embeds cubins)."""
    names: list[str] = []
    at = image.find(b"\x7fELF")
    while at >= 0:
        if image[at + 4] == 2:
            with contextlib.suppress(struct.error, ValueError, IndexError):
                names += _objects(image[at:])
        at = image.find(b"\x7fELF", at + 4)
    return sorted(set(names))


def _objects(data: bytes) -> list[str]:
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for sh in sections:
        if sh[1] != 2:  # SHT_SYMTAB
            continue
        strtab = sections[sh[6]]
        for off in range(sh[4], sh[4] + sh[5], sh[9] or 24):
            st_name, st_info = struct.unpack_from("<IB", data, off)
            if st_info & 0xF == 1:  # STT_OBJECT
                end = data.index(b"\0", strtab[4] + st_name)
                names.append(data[strtab[4] + st_name : end].decode())
    return names


def global_bytes(drv: Any, module: Any, name: str) -> bytes | None:
    from graphpersist.memory.tensors import bytes_at

    err, ptr, size = drv.cuModuleGetGlobal(module, name.encode())
    if int(err) != 0:
        return None
    return bytes(bytes_at(int(ptr), int(size)).cpu().numpy().tobytes()) if size else b""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the findings as JSON here")
    a = arguments(__doc__, ap)
    c = capture(a.m, a.k, a.n)
    drv = c.drv
    from graphpersist.graph import images

    table = images.ImageTable.current()
    found: list[dict[str, Any]] = []
    seen: set[str] = set()
    for _nd, p, _name in c.kernel_nodes():
        sha, kname, load = table.resolve(p.func)
        print(f"kernel {kname[:90]} <- image {sha[:16]} ({load.kind}, {load.format}, {load.size} bytes)")
        if sha in seen:
            continue
        seen.add(sha)
        data = load.data()
        own = drv.cuFuncGetModule(p.func)[1]
        fresh = images.LoadedImages()
        fresh.load(sha, load.kind, data)
        handle = fresh.handles[sha]
        fresh_mod = drv.cuLibraryGetModule(handle)[1] if load.kind == "library" else handle
        objects = elf_objects(data)
        print(f"  image starts {data[:8].hex()}, {len(objects)} object symbol(s)")
        for name in objects:
            mine, theirs = global_bytes(drv, own, name), global_bytes(drv, fresh_mod, name)
            same = mine == theirs
            entry = {
                "image": sha[:16],
                "kernel": kname[:90],
                "global": name,
                "size": None if mine is None else len(mine),
                "same": same,
                "library_copy": None if mine is None else hashlib.sha256(mine).hexdigest()[:16],
                "fresh_copy": None if theirs is None else hashlib.sha256(theirs).hexdigest()[:16],
                "library_head": None if mine is None else mine[:32].hex(),
                "fresh_head": None if theirs is None else theirs[:32].hex(),
            }
            found.append(entry)
            print(f"  global {name} ({entry['size']} bytes): {'same' if same else 'DIFFERS'} "
                  f"library {entry['library_head']} fresh {entry['fresh_head']}")  # fmt: skip
    if a.out:
        Path(a.out).write_text(json.dumps(found, indent=1))
    differ = [f for f in found if not f["same"]]
    print(f"globals_probe: {len(found)} global(s) in {len(seen)} image(s), {len(differ)} differ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
