"""The deep_ep wheels: pinned registry wheels in, `deep_ep-<version>+gp.N` wheels out, and the patched Buffer on CPU.

What `make build` does to DeepEP (build/pins.toml [engines.deep_ep]): the pinned tokenspeed-deepep wheels (one per
Python) get patches/deep_ep/series with zero fuzz and overlays/deep_ep, are renamed to the distribution deep_ep and
stamped, with native code byte-identical and a valid RECORD, reproducibly. The patched package is then installed into
a venv with CPU torch (the vLLM CPU venv's) and its Buffer built on a gloo group with a stand-in for the CUDA
extension: persistence off passes the caller's use_fabric/allow_mnnvl to the extension untouched, save and load pass
False, and NVSHMEM is refused before the extension is touched. The symbol check against torch 2.11.0 is
tests/cpu/test_deep_ep_symbols.py; the overlay's own cases are tests/cpu/test_deep_ep_overlay.py.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from module_file import load_module

from gpdist.fetch import fetch
from gpdist.pins import LIBRARY, Pins
from gpdist.unpack import upstream_tree as pinned_tree
from gpdist.wheelmeta import WheelName, parse_record
from gptools import hooks
from gptools.apply import apply_series
from gptools.series import load_series

ENGINE = "deep_ep"
PYTHONS = ["cp310", "cp311", "cp312", "cp313"]
OVERLAY = Path(__file__).resolve().parents[2] / "overlays" / "deep_ep" / "deep_ep" / "graphpersist_buffer.py"


def _overlay() -> ModuleType:
    return load_module(OVERLAY, "gp_test_deep_ep_overlay_consts")


def _python_tag(filename: str) -> str:
    return WheelName.parse(filename).tags.split("-")[0]


def _ours(dist_dir: Path, pins: Pins) -> dict[str, Path]:
    """Python tag -> our built deep_ep wheel in dist/."""
    pin = pins.engine(ENGINE)
    out = {}
    for art in pin.wheels:
        path = dist_dir / pins.dist_wheel(pin, art).filename
        assert path.is_file(), f"{path.name} missing from {dist_dir}: {sorted(p.name for p in dist_dir.iterdir())}"
        out[_python_tag(art.filename)] = path
    return out


def _record_checked(wheel: Path) -> dict[str, bytes]:
    """Every member's bytes, after checking that RECORD lists each member once with its sha256 and size."""
    with zipfile.ZipFile(wheel) as zf:
        members = {n: zf.read(n) for n in zf.namelist() if not n.endswith("/")}
    [record_name] = [n for n in members if n.endswith(".dist-info/RECORD")]
    record = parse_record(members[record_name].decode())
    assert set(record) == set(members), f"{wheel.name}: RECORD and members differ: {set(record) ^ set(members)}"
    for name, data in members.items():
        digest, size = record[name]
        if name == record_name:
            assert (digest, size) == ("", ""), name
            continue
        want = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert (digest, int(size)) == (want, len(data)), f"{wheel.name}: {name}"
    return members


# ------------------------------------------------------------------------------------------------------ the pins


def test_one_pinned_wheel_per_python_of_one_release(pins: Pins) -> None:
    pin = pins.engine(ENGINE)
    assert (pin.project, pin.dist_name, pin.kind) == ("tokenspeed-deepep", "deep_ep", LIBRARY)
    assert ENGINE not in pins.serving_engines, "deep_ep gets no offline bundle of its own"
    assert _python_tag(pin.wheel.filename) == "cp312", "the primary wheel is the GPU host's Python"
    assert sorted(_python_tag(a.filename) for a in pin.wheels) == PYTHONS  # the registry has no 3.14 wheel
    for art in pin.wheels:
        name = WheelName.parse(art.filename)
        assert (name.distribution, name.version) == ("tokenspeed_deepep", pin.version)
        assert name.tags.endswith("-manylinux_2_28_x86_64") and art.size and len(art.sha256) == 64
    assert pins.verify["torch"].filename == f"torch-{pin.requires_torch}-cp312-cp312-manylinux_2_28_x86_64.whl"


@pytest.mark.network
def test_the_pinned_wheels_differ_only_in_their_extension(pins: Pins) -> None:
    """So the series, hooks.toml and `make edit`/`make rebase`, which work on the cp312 wheel, hold for all four."""
    contents = {}
    for art in pins.engine(ENGINE).wheels:
        with zipfile.ZipFile(fetch(art)) as zf:
            contents[_python_tag(art.filename)] = {
                n: zf.read(n) for n in zf.namelist() if not n.endswith((".so", "/WHEEL", "/RECORD"))
            }
    primary = contents["cp312"]
    assert {"deep_ep/__init__.py", "deep_ep/buffer.py", "deep_ep/utils.py"} <= set(primary)
    for tag, files in contents.items():
        assert files == primary, (
            f"{tag}: {sorted(n for n in set(files) | set(primary) if files.get(n) != primary.get(n))}"
        )


@pytest.mark.network
def test_the_series_applies_with_zero_fuzz_to_every_pinned_wheel(pins: Pins, tmp_path: Path) -> None:
    pin = pins.engine(ENGINE)
    patches = load_series(pin.patches_dir)
    assert [p.name for p in patches] == [
        "0001-take-deepep-s-no-fabric-nvl-path-under-graph-persist.patch",
        "0002-refuse-nvfp4-and-single-batch-overlap-arguments-this.patch",
        "0003-keep-the-fabric-settings-a-deepep-buffer-was-created.patch",
    ]
    for art in pin.wheels:
        results = apply_series(pinned_tree(pin, artifact=art), pin.patches_dir, dry_run=True)
        assert [r.name for r in results] == [p.name for p in patches], art.filename


@pytest.mark.network
def test_hooks_match_the_pinned_tree_and_cover_every_patched_file(pins: Pins) -> None:
    pin = pins.engine(ENGINE)
    hooks_file = pin.patches_dir / hooks.HOOKS_FILE
    assert hooks.check_hooks(pinned_tree(pin), hooks_file) == []
    declared = {h.module.replace(".", "/") + ".py" for h in hooks.load_hooks(hooks_file)}
    patched = {fd.path for patch in load_series(pin.patches_dir) for fd in patch.files}
    assert patched == {"deep_ep/buffer.py"} and patched <= declared


@pytest.mark.network
def test_the_refused_keywords_are_what_the_engines_pass_and_the_pinned_deep_ep_lacks(
    pins: Pins, upstream_tree: Callable[[str], Path]
) -> None:
    """The seam, read from the pinned engines: the keyword arguments SGLang 0.5.17 and vLLM 0.26.0 pass to
    low_latency_dispatch/low_latency_combine that the pinned DeepEP's methods lack are exactly the ones the overlay
    names (NVFP4 dispatch; single-batch overlap), apart from SGLang's Ascend-only topk_weights."""
    gb = _overlay()
    callers = [
        upstream_tree("sglang") / "sglang/srt/layers/moe/token_dispatcher/deepep.py",
        upstream_tree("vllm") / "vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_ll.py",
    ]
    passed = {"low_latency_dispatch": set(), "low_latency_combine": set()}
    for path in callers:
        for method, names in _keywords_passed(ast.parse(path.read_text()), set(passed)).items():
            passed[method] |= names
    tree = ast.parse((pinned_tree(pins.engine(ENGINE)) / "deep_ep/buffer.py").read_text())
    [buffer] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Buffer"]
    params = {
        f.name: {a.arg for a in f.args.args + f.args.kwonlyargs}
        for f in buffer.body
        if isinstance(f, ast.FunctionDef) and f.name in passed
    }
    lacking = {method: passed[method] - params[method] for method in passed}
    assert lacking["low_latency_dispatch"] - {"topk_weights"} == set(gb.NVFP4_KWARGS)
    assert lacking["low_latency_combine"] == set(gb.SINGLE_BATCH_OVERLAP_KWARGS)


def _keywords_passed(module: ast.Module, methods: set[str]) -> dict[str, set[str]]:
    """Keyword names passed in calls `<x>.<method>(...)`, including those of dict(...) calls splatted with ** there
    or assigned, in the same function, to a name that is splatted."""
    out: dict[str, set[str]] = {m: set() for m in methods}
    for func in ast.walk(module):
        if not isinstance(func, ast.FunctionDef):
            continue
        dicts: dict[str, set[str]] = {}
        for node in ast.walk(func):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and _is_dict_call(node.value):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        dicts.setdefault(target.id, set()).update(k.arg for k in node.value.keywords if k.arg)
        for node in ast.walk(func):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in methods):
                continue
            for kw in node.keywords:
                if kw.arg:
                    out[node.func.attr].add(kw.arg)
                elif isinstance(kw.value, ast.Name):
                    out[node.func.attr] |= dicts.get(kw.value.id, set())
                else:
                    for inner in ast.walk(kw.value):
                        if isinstance(inner, ast.Call) and _is_dict_call(inner):
                            out[node.func.attr].update(k.arg for k in inner.keywords if k.arg)
    return out


def _is_dict_call(call: ast.Call) -> bool:
    return isinstance(call.func, ast.Name) and call.func.id == "dict"


# ------------------------------------------------------------------------------------------------ the built wheels


def test_dist_holds_a_deep_ep_wheel_per_pinned_python(dist_dir: Path, pins: Pins) -> None:
    version = pins.dist_version(pins.engine(ENGINE).version)
    assert {p.name for p in dist_dir.glob("deep_ep-*.whl")} == {
        f"deep_ep-{version}-{tag}-{tag}-manylinux_2_28_x86_64.whl" for tag in PYTHONS
    }
    assert not list(dist_dir.glob("tokenspeed*")), "the upstream distribution name is gone"


@pytest.mark.parametrize("tag", PYTHONS)
def test_name_metadata_and_record_change_together(dist_dir: Path, pins: Pins, tag: str) -> None:
    pin = pins.engine(ENGINE)
    version = pins.dist_version(pin.version)
    members = _record_checked(_ours(dist_dir, pins)[tag])
    info = f"deep_ep-{version}.dist-info"
    assert {n.split("/")[0] for n in members if ".dist-info/" in n} == {info}
    headers = members[f"{info}/METADATA"].decode().partition("\n\n")[0].split("\n")
    assert headers == [
        "Metadata-Version: 2.1",
        "Name: deep_ep",
        f"Version: {version}",
        "License-File: LICENSE",
        f"Requires-Dist: {pins.runtime_name}=={pins.runtime_version}",
        f"Requires-Dist: torch=={pin.requires_torch}",
    ]
    wheel = members[f"{info}/WHEEL"].decode()
    assert f"Tag: {tag}-{tag}-manylinux_2_28_x86_64" in wheel and "Root-Is-Purelib: false" in wheel


@pytest.mark.parametrize("tag", PYTHONS)
def test_only_the_series_overlay_and_metadata_differ_from_upstream(dist_dir: Path, pins: Pins, tag: str) -> None:
    pin = pins.engine(ENGINE)
    [art] = [a for a in pin.wheels if _python_tag(a.filename) == tag]
    old_info, new_info = WheelName.parse(art.filename).dist_info, pins.dist_wheel(pin, art).dist_info
    upstream = {n.replace(old_info, new_info, 1): data for n, data in _record_checked(fetch(art)).items()}
    ours = _record_checked(_ours(dist_dir, pins)[tag])
    assert set(upstream) <= set(ours), "every upstream file is in our wheel"
    assert set(ours) - set(upstream) == {"deep_ep/graphpersist_buffer.py"}, "only the overlay adds a file"
    changed = {n for n in upstream if upstream[n] != ours[n]}
    assert changed == {"deep_ep/buffer.py", f"{new_info}/METADATA", f"{new_info}/RECORD"}
    [native] = [n for n in upstream if n.endswith(".so")]
    assert native == f"deep_ep_cpp.cpython-{tag[2:]}-x86_64-linux-gnu.so"
    assert ours[native] == upstream[native], "the extension is byte-identical to upstream"
    assert ours["deep_ep/graphpersist_buffer.py"] == OVERLAY.read_bytes()
    compile(ours["deep_ep/buffer.py"], "deep_ep/buffer.py", "exec", dont_inherit=True)


def test_make_build_engine_deep_ep_builds_just_it_reproducibly(
    dist_dir: Path, pins: Pins, tmp_path: Path, repo_root: Path
) -> None:
    """`make build ENGINE=deep_ep` (gpdist build --engine deep_ep) writes the deep_ep wheels and the runtime wheel
    only, byte-identical when built twice (the second time offline) and to the ones of `make build`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    runs = []
    for name, extra in (("a", []), ("b", ["--offline"])):
        out = tmp_path / name
        cmd = [sys.executable, "-m", "gpdist", "build", "--engine", ENGINE, "--out", str(out), *extra]
        subprocess.run(cmd, check=True, env=env, cwd=repo_root, capture_output=True)
        runs.append({p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.glob("*.whl")})
    assert runs[0] == runs[1]
    assert {n for n in runs[0] if not n.startswith("deep_ep-")} == {
        f"{pins.runtime_name}-{pins.runtime_version}-py3-none-manylinux_2_28_x86_64.whl"
    }
    made = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in dist_dir.glob("deep_ep-*.whl")}
    assert {n: d for n, d in runs[0].items() if n.startswith("deep_ep-")} == made


# ------------------------------------------------------------------------------------------ the patched Buffer, on CPU

PROBE = textwrap.dedent(
    """
    import json, os, sys, types
    import importlib.metadata as md

    out = {}
    try:
        import deep_ep  # the real CUDA extension: it needs torch's CUDA libraries, which CPU torch lacks
        out["real_import"] = "imported"
    except ImportError as exc:
        out["real_import"] = str(exc)
    for name in [m for m in sys.modules if m == "deep_ep" or m.startswith(("deep_ep.", "deep_ep_cpp"))]:
        del sys.modules[name]

    import torch
    import torch.distributed as dist

    made = []

    class Runtime:  # deep_ep_cpp.Buffer's stand-in: records what the Python Buffer hands the extension
        def __init__(self, *args):
            made.append(list(args))
        def get_local_device_id(self):
            return 0
        def get_local_ipc_handle(self):
            return b"ipc"
        def get_num_rdma_ranks(self):
            return 1
        def get_rdma_rank(self):
            return 0
        def sync(self, device_ids, ipc_handles, root_unique_id):
            self.synced = (device_ids, ipc_handles, root_unique_id)
        def is_available(self):
            return True

    cpp = types.ModuleType("deep_ep_cpp")
    cpp.Buffer, cpp.Config, cpp.EventHandle, cpp.topk_idx_t = Runtime, type("Config", (), {}), object, torch.int64
    sys.modules["deep_ep_cpp"] = cpp
    import deep_ep
    import deep_ep.buffer
    import inspect

    out["file"] = deep_ep.__file__
    out["version"] = md.version("deep_ep")
    out["requires"] = md.requires("deep_ep")
    out["init_params"] = list(inspect.signature(deep_ep.Buffer.__init__).parameters)
    deep_ep.buffer.check_nvlink_connections = lambda group: None  # asks torch.cuda for the device name
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    group = dist.group.WORLD

    def make(mode, **kw):
        os.environ.pop("GRAPHPERSIST_MODE", None)
        if mode:
            os.environ["GRAPHPERSIST_MODE"] = mode
        before = len(made)
        try:
            buf = deep_ep.Buffer(group, 1 << 20, **kw)
        except Exception as exc:
            return {"error": type(exc).__name__, "message": str(exc), "extension_made": len(made) > before}
        return {"use_fabric": made[-1][-1], "args": made[-1][:-1], "synced": list(buf.runtime.synced[0])}

    out["off"] = make(None, use_fabric=True, allow_mnnvl=True)
    out["off_plain"] = make(None)
    out["save"] = make("save", use_fabric=True, allow_mnnvl=True)
    out["load"] = make("load", use_fabric=True)
    out["save_low_latency"] = make("save", low_latency_mode=True, num_rdma_bytes=1 << 20)
    os.environ.pop("GRAPHPERSIST_MODE", None)
    buf = deep_ep.Buffer(group, 1 << 20)
    try:
        buf.low_latency_dispatch(torch.zeros(1, 8), torch.zeros(1, 1, dtype=torch.int64), 1, 2, use_nvfp4=True)
    except TypeError as exc:
        out["nvfp4"] = [type(exc).__name__, str(exc)]
    dist.destroy_process_group()
    print(json.dumps(out))
    """
)


@pytest.mark.slow  # the vLLM CPU venv it shares takes a minute or two to build once per session
def test_the_patched_buffer_on_cpu_torch(dist_dir: Path, pins: Pins, vllm_venv: Path, tmp_path: Path) -> None:
    """Our cp311 wheel installed (--no-deps) beside the CPU venv's torch and graphpersist, imported with a stand-in
    for the CUDA extension, and its Buffer built on a one-rank gloo group in each persistence mode."""
    python = vllm_venv / "bin" / "python"
    target = tmp_path / "site"
    pip = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--disable-pip-version-check"]
    subprocess.run([*pip, "--target", str(target), str(_ours(dist_dir, pins)["cp311"])], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GRAPHPERSIST_MODE", "GRAPHPERSIST_DIR")}
    proc = subprocess.run(
        [str(python), "-c", PROBE, str(tmp_path / "store")],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": str(target)},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])

    # The real extension is there and fails only for torch's CUDA libraries.
    assert any(lib in out["real_import"] for lib in ("libc10_cuda.so", "libtorch_cuda.so", "libcudart.so.13")), out
    assert out["file"] == str(target / "deep_ep" / "__init__.py")
    assert out["version"] == pins.dist_version(pins.engine(ENGINE).version)
    assert sorted(out["requires"]) == sorted([f"{pins.runtime_name}=={pins.runtime_version}", "torch==2.11.0"])
    assert out["init_params"][-4:] == ["use_fabric", "explicitly_destroy", "enable_shrink", "comm"]

    # Off is upstream: the caller's use_fabric reaches the extension. (rank, size, nvl, rdma, ll, destroy, shrink)
    assert out["off"]["use_fabric"] is True and out["off"]["args"] == [0, 1, 1 << 20, 0, False, False, False]
    assert out["off_plain"]["use_fabric"] is False and out["off"]["synced"] == [0]
    # Save and load: the no-fabric NVL path.
    assert out["save"]["use_fabric"] is False and out["load"]["use_fabric"] is False
    assert out["save"]["args"] == out["off"]["args"]
    # NVSHMEM refused with the settings named and the advice, before the extension is made.
    refused = out["save_low_latency"]
    assert refused["error"] == "PersistRefusal" and refused["extension_made"] is False
    lines = refused["message"].splitlines()
    assert [line.split(": ")[2] for line in lines[:2]] == ["low_latency_mode=True", "num_rdma_bytes=1048576"]
    assert lines[-1].startswith("Use DeepEP's normal (high-throughput) mode within one node")
    # An argument this build lacks: a TypeError that says what to do.
    assert out["nvfp4"][0] == "UnsupportedByThisBuild"
    assert out["nvfp4"][1].startswith("graphpersist: deep_ep.Buffer.low_latency_dispatch() got use_nvfp4: ")
    assert f"(deep_ep {out['version']})" in out["nvfp4"][1]
