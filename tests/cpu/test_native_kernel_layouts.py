"""LOAD holds every kernel row of an archive to its function's live parameter layout before the driver reads a byte.

The driver reads kernelParams[j] for as many bytes as the *live* function's parameter j is long, whatever the
archive says; the kernel table only names where each parameter starts. So a crafted archive (its hashes recomputed)
could point the driver past the parameter blob or hand a kernel another layout. These tests run the real interposer
preloaded over the fake driver (tests/cpu/native/fakecuda.c), whose cuGraphAddKernelNode_v2 reads parameters the way
the driver does and whose cuFuncGetParamInfo answers per fake function."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from native_fixtures import build_fake_driver, child_env, run_child

from graphpersist.graph import format as graphformat
from graphpersist.memory import region

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed: cannot build the fake")

SRC = Path(region.__file__).resolve().parents[2]  # the runtime's source folder (graphpersist/ inside)
K0 = [[0, 8], [8, 4], [16, 8]]  # kernel 'k0': a pointer, an int, a pointer
K1 = [[0, 8], [8, 8]]  # kernel 'k1': two pointers

PRELUDE = """
import ctypes, json, os
from graphpersist.graph import build as graphbuild, format as graphformat, images
from graphpersist.graph.format import GraphFormatError
fake = ctypes.CDLL(os.environ["GP_LIBCUDA"])
fake.fake_make_func.restype = ctypes.c_void_p
fake.fake_node_params.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]

class Drv:  # the two cuda-bindings calls rebuild_native makes around the native one
    destroyed = 0
    @staticmethod
    def cuGraphCreate(flags):
        return 0, 0x7000
    @classmethod
    def cuGraphDestroy(cls, graph):
        cls.destroyed += 1
        return (0,)

graphbuild.driver = lambda: Drv

def make_func(layout):
    n = len(layout)
    offs = (ctypes.c_uint32 * max(n, 1))(*[o for o, _s in layout])
    sizes = (ctypes.c_uint32 * max(n, 1))(*[s for _o, s in layout])
    return fake.fake_make_func(n, offs, sizes)

def node_params(i, size):
    buf = ctypes.create_string_buffer(256)
    func = fake.fake_node_params(i, buf, 256)
    return func, buf.raw[:size].hex()

out = {}
"""


@pytest.fixture(scope="module")
def libs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return build_fake_driver(tmp_path_factory.mktemp("klayouts"))


def run(libs: dict[str, str], code: str) -> dict[str, Any]:
    """Runs `code` (after PRELUDE) in a process under the interposer over the fake driver; returns its `out`."""
    return run_child(PRELUDE, code, child_env(libs, 0x500000000000, paths=[SRC]))[0]


def graph(k1_layout: list[list[int]], blob_size: int, k0_layout: list[list[int]] = K0) -> dict[str, Any]:
    """A description of two kernel nodes (k0 then k1, parameters back to back) as SAVE writes it, plus its blob and
    kernel table; the layouts are what the archive claims, which a crafted archive may set to anything."""
    p0 = max(o + s for o, s in k0_layout)
    nodes = [
        {"type": "kernel", "func": f, "name": f"k{f}", "image": "ab" * 32, "grid": [1, 1, 1], "block": [32, 1, 1],
         "smem": 0, "layout": lay, "params": [off, size], "attrs": {"1": "05"}}
        for f, lay, off, size in ((0, k0_layout, 0, p0), (1, k1_layout, p0, blob_size - p0))
    ]  # fmt: skip
    desc = {"nodes": nodes, "edges": [], "funcs": [["ab" * 32, "k0", {}], ["ab" * 32, "k1", {}]]}
    blob = bytes(range(blob_size))
    table = graphformat.pack_kernel_table(desc)
    desc.update(blob_size=blob_size, table_size=len(table))
    return {"desc": desc, "blob": blob.hex(), "table": table.hex()}


def rebuild_code(g: dict[str, Any]) -> str:
    """Child code: rebuild_native of `g` with live functions k0 = K0, k1 = K1; `out` gets the result or refusal."""
    return f"""
        g = json.loads({json.dumps(json.dumps(g))})
        desc, blob, table = g["desc"], bytes.fromhex(g["blob"]), bytes.fromhex(g["table"])
        handles = [make_func({K0}), make_func({K1})]
        loaded = images.LoadedImages()
        for (sha, name, _attrs), h in zip(desc["funcs"], handles):
            loaded.funcs[(sha, name)] = h  # resolved as LOAD resolves them; the layouts come from the driver
        funcs = graphbuild.LiveFuncs.of(loaded, desc["funcs"])
        try:
            graphbuild.rebuild_native("g", desc, blob, table, funcs, hashed=True)
            out["built"] = True
        except GraphFormatError as exc:
            out["refused"] = str(exc)
        out["nodes"] = fake.fake_kernel_nodes()
        out["destroyed"] = Drv.destroyed
        out["params"] = [node_params(i, 24) for i in range(fake.fake_kernel_nodes())]
        out["set_attrs"] = fake.fake_set_attrs()
    """


def light(desc: dict[str, Any]) -> dict[str, Any]:
    return {**desc, "nodes": [{"type": "kernel"} for _ in desc["nodes"]]}


def test_a_sound_table_rebuilds_and_the_driver_reads_the_saved_bytes(libs: dict[str, str]) -> None:
    g = graph(K1, 40)
    out = run(libs, rebuild_code(g))
    assert out.get("built") is True and out["nodes"] == 2 and out["destroyed"] == 0
    blob = bytes.fromhex(g["blob"])
    want0 = blob[0:12] + bytes(4) + blob[16:24]  # bytes 12..15 are no parameter's: the driver copies none there
    want1 = blob[24:40] + bytes(8)
    assert out["params"] == [[0, want0.hex()], [1, want1.hex()]]


def test_a_saved_launch_attribute_is_set_unless_it_equals_what_a_fresh_node_of_its_function_reads_back(
    libs: dict[str, str],
) -> None:
    """The fake driver reads attribute 1 of these nodes back as 64 bytes of 0x01 and cannot read attribute 3: k0's
    saved attribute 1 equals that default (not set), k1's differs (set), k1's attribute 3 cannot be compared (set)."""
    g = graph(K1, 40)
    g["desc"]["nodes"][0]["attrs"] = {"1": "01" * 64}
    g["desc"]["nodes"][1]["attrs"] = {"1": "05", "3": "07"}
    g["table"] = graphformat.pack_kernel_table(g["desc"]).hex()
    g["desc"]["table_size"] = len(bytes.fromhex(g["table"]))
    out = run(libs, rebuild_code(g))
    assert out.get("built") is True and out["nodes"] == 2
    assert out["set_attrs"] == 2


def test_a_last_parameter_that_starts_inside_the_blob_but_ends_past_it_is_refused(libs: dict[str, str]) -> None:
    """k1's second parameter starts at blob byte 32 < 36 (what the CPU checks of the table see), but the live
    function says it is 8 bytes long: the driver would read 4 bytes past the blob."""
    g = graph([[0, 8], [8, 4]], 36)
    assert graphformat.table_problem(light(g["desc"]), bytes.fromhex(g["table"]), 36, 2) is None
    out = run(libs, rebuild_code(g))
    assert out["nodes"] == 0 and out["destroyed"] == 1  # refused before the first node, k0's, was added
    msg = out["refused"]
    assert msg.startswith("graph 'g' node 1 kernel 'k1': ")
    assert "parameter 1 (8 bytes at offset 8) ends past the 36-byte blob" in msg
    assert "saved 2 parameters at offsets [0, 8] from byte 24 of the 36-byte parameter blob" in msg
    assert "live (offset, size) [[0, 8], [8, 8]]" in msg


def test_a_row_whose_offsets_differ_from_the_functions_layout_is_refused(libs: dict[str, str]) -> None:
    g = graph([[0, 8], [12, 4]], 40)
    assert graphformat.table_problem(light(g["desc"]), bytes.fromhex(g["table"]), 40, 2) is None
    out = run(libs, rebuild_code(g))
    assert out["nodes"] == 0
    assert out["refused"].startswith("graph 'g' node 1 kernel 'k1': ")
    assert "(parameter 1 at offset 12, the function's at 8)" in out["refused"]
    assert "saved 2 parameters at offsets [0, 12]" in out["refused"]


def test_a_row_with_another_parameter_count_is_refused(libs: dict[str, str]) -> None:
    g = graph(K1, 40, k0_layout=[[0, 8], [8, 4], [16, 4], [20, 4]])
    out = run(libs, rebuild_code(g))
    assert out["nodes"] == 0
    assert out["refused"].startswith("graph 'g' node 0 kernel 'k0': ")
    assert "(4 parameters, the function 3)" in out["refused"]
    assert "live (offset, size) [[0, 8], [8, 4], [16, 8]]" in out["refused"]


def test_layouts_are_asked_of_the_driver_once_per_function(libs: dict[str, str]) -> None:
    out = run(
        libs,
        """
        h = make_func([[0, 8], [8, 4], [16, 8]])
        loaded = images.LoadedImages()
        loaded.funcs[("s", "k")] = h
        out["layout"] = [loaded.layout("s", "k", {}) for _ in range(3)]
        out["calls"] = fake.fake_param_info_calls()  # 3 parameters + the answer past the last, once
        fake.fake_set_param_info_result(999)
        try:
            images.param_layout(make_func([[0, 8]]), "k2")
        except images.ImageError as exc:
            out["error"] = str(exc)
        """,
    )
    assert out["layout"] == [[[0, 8], [8, 4], [16, 8]]] * 3
    assert out["calls"] == 4
    assert out["error"] == (
        "kernel 'k2': cannot read its parameter layout: cuFuncGetParamInfo(parameter 1) failed with 999"
    )


def test_the_reference_rebuild_holds_kernel_nodes_to_the_live_layouts_too() -> None:
    """The reference rebuild (tools/gpdiag/rebuild.py) reads each node's layout from its JSON: equal offsets and sizes,
    inside the blob."""
    from gpdiag import rebuild as reference

    live = {"k0": tuple(map(tuple, K0)), "k1": tuple(map(tuple, K1))}
    for k1, size, why in (
        ([[0, 8], [8, 4]], 36, "parameter 1 (8 bytes at offset 8) ends past the 36-byte blob"),
        ([[0, 8], [12, 4]], 40, "parameter 1 at offset 12, the function's at 8"),
        ([[0, 8], [8, 4]], 40, "parameter 1 is 4 bytes, the function's 8"),
    ):
        desc = graph(k1, size)["desc"]
        with pytest.raises(graphformat.GraphFormatError) as info:
            reference.rebuild("g", desc, bytes(size), None, hashed=True, layouts=lambda _s, name, _a: live[name])
        assert str(info.value).startswith(f"graph 'g' node 1 kernel 'k1': its saved parameter layout does not fit "
                                          f"the live function ({why})")  # fmt: skip


def test_in_load_hands_the_reference_rebuild_what_load_resolved_and_puts_the_native_builder_back() -> None:
    """gpdiag.rebuild.in_load(): load()'s native builder is the reference rebuild inside the block, fed the live
    functions and layouts load() resolved (a wrong saved layout is refused by it, naming the node), and LOAD's own
    builder and CPU stage are back after it."""
    from gpdiag import rebuild as reference

    from graphpersist import loadstage
    from graphpersist.graph import build as graphbuild

    native, stage = graphbuild.rebuild_native, loadstage.rank_stage
    funcs = graphbuild.LiveFuncs([1, 2], [tuple(map(tuple, K0)), tuple(map(tuple, K1))])
    with reference.in_load(), pytest.raises(graphformat.GraphFormatError) as info:
        assert graphbuild.rebuild_native is not native and loadstage.rank_stage is not stage
        graphbuild.rebuild_native("g", graph([[0, 8], [12, 4]], 40)["desc"], bytes(40), b"", funcs, hashed=True)
    assert str(info.value).startswith("graph 'g' node 1 kernel 'k1': its saved parameter layout does not fit the live "
                                      "function (parameter 1 at offset 12, the function's at 8)")  # fmt: skip
    assert graphbuild.rebuild_native is native and loadstage.rank_stage is stage
