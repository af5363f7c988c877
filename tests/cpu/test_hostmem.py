"""Pinned host memory that graphs read (memory/hostmem.py, graph/walk.py): SAVE takes a kernel-parameter word in a
placed setup allocation as a host address to keep, refuses one in any other pinned memory naming it and why, and
LOAD refuses unless each recorded allocation is live at the same address with the same size. The interposer runs
for real in a child process over the fake driver (tests/cpu/native/fakecuda.c), as in test_native_host.py."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest
from native_fixtures import build_fake_driver, child_env, run_child

from graphpersist.graph.format import GraphFormatError
from graphpersist.graph.walk import HostMemory, _ForeignPointers
from graphpersist.memory import region

OVERLAY = Path(region.__file__).resolve().parents[2]
LO, HI = 0x500000000000, 0x500000000000 + (1 << 30)
HOST = 0x4F0000000000


def words(*vals: int) -> bytes:
    return struct.pack(f"<{len(vals)}Q", *vals)


def test_a_word_in_restorable_host_memory_is_kept_as_a_host_address() -> None:
    fp = _ForeignPointers(LO, HI, HostMemory(restorable=[(HOST, 4096), (HOST + 8192, 4096)]))
    inside = fp.scan_params("node 3 kernel 'notify_dispatch'", words(LO + 64, HOST + 8, 7, HOST + 8192))
    assert inside == {LO + 64}
    assert fp.host == {HOST + 8, HOST + 8192}


def test_a_word_in_other_pinned_memory_is_refused_naming_it_and_why() -> None:
    hm = HostMemory(restorable=[(HOST, 4096)], others=[(HOST + 4096, 4096, "allocated after mark_setup()")])
    fp = _ForeignPointers(LO, HI, hm)
    with pytest.raises(GraphFormatError) as exc:
        fp.scan_params("node 3 kernel 'notify_dispatch'", words(HOST, HOST + 4100))
    msg = str(exc.value)
    assert "parameter bytes 8..15" in msg and f"{HOST + 4100:#x}" in msg and f"{HOST + 4096:#x}+4096" in msg
    assert "allocated after mark_setup()" in msg and "SAVE refused" in msg


PRELUDE = """
import json, ctypes
from fakegp import Gp
from graphpersist.errors import PersistError
from graphpersist.memory import hostmem, region
gp = Gp()
out = {}
"""


def run(tmp_path: Path, code: str) -> dict:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed: cannot build the fake")
    libs = build_fake_driver(tmp_path)
    env = child_env(libs, LO, paths=[OVERLAY], GP_HOST_BASE=hex(HOST))
    return run_child(PRELUDE, code, env, timeout=120)[0]


def test_save_keeps_setup_allocations_and_load_checks_them(tmp_path: Path) -> None:
    out = run(tmp_path, """
        rc, counter = gp.host_alloc(8, 2)          # setup: DeepEP's counters
        rc, experts = gp.host_alloc(4096, 2)
        setup_n = region.host_info().n_events      # what mark_setup() records
        rc, late = gp.host_alloc(64, 2)            # after setup
        rc, wc = gp.host_alloc(64, 4)              # write-combined: left to the driver
        hm = hostmem.for_save(setup_n)
        out["restorable"] = hm.restorable
        out["others"] = [[a, s, why] for a, s, why in hm.others]
        out["late"], out["wc"] = late, wc
        rec = hostmem.record([counter, counter + 4, experts + 16], hm)
        out["record"] = rec
        from graphpersist.archive import codec
        from graphpersist.archive.manifest import ManifestError, RankExtra
        typed = codec.from_dict(RankExtra, json.loads(json.dumps({"host_memory": rec}))).host_memory  # as LOAD reads it
        out["checked"] = hostmem.check_load(typed)
        out["none"] = hostmem.check_load(None)
        gp.free_host(experts)                      # LOAD's setup differs: one allocation is gone
        try:
            hostmem.check_load(typed)
        except PersistError as exc:
            out["refused"] = str(exc)
        try:
            codec.from_dict(RankExtra, {"host_memory": {"ranges": [[1, "2"]], "words": 1}})
        except ManifestError as exc:
            out["malformed"] = str(exc)
        """)  # fmt: skip
    assert out["restorable"] == [[HOST, 4096], [HOST + 4096, 4096]]
    whys = {a: why for a, _, why in out["others"]}
    assert whys[out["late"]] == "allocated after mark_setup(), so LOAD's setup does not make it again: allocate it "\
        "during setup"  # fmt: skip
    assert whys[out["wc"]] == "write-combined (cuMemHostRegister cannot make it)"
    assert out["record"] == {"ranges": [[HOST, 4096], [HOST + 4096, 4096]], "words": 3}
    assert out["checked"] == 2 and out["none"] == 0
    assert f"graphs read {HOST + 4096:#x}+4096 at SAVE" in out["refused"] and "LOAD refused" in out["refused"]
    assert out["malformed"].startswith("extra.host_memory.ranges[0][1]: ")
