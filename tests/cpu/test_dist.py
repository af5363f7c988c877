"""The wheels in dist/: names, stamped metadata, valid RECORDs, unchanged native code, install, reproducibility."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from gpdist.fetch import fetch
from gpdist.pins import Pins
from gpdist.wheelmeta import WheelName, parse_record
from gpdist.wheelzip import read_raw

pytestmark = pytest.mark.network


def engine_wheel(dist_dir: Path, pins: Pins, engine: str) -> Path:
    pin = pins.engine(engine)
    name = WheelName.parse(pin.wheel.filename).with_version(pins.dist_version(pin.version)).filename
    path = dist_dir / name
    assert path.is_file(), f"{name} missing from {dist_dir}: {sorted(p.name for p in dist_dir.iterdir())}"
    return path


def test_dist_holds_exactly_the_three_wheels(runtime_wheel: Path, dist_dir: Path, pins: Pins) -> None:
    expected = {engine_wheel(dist_dir, pins, e).name for e in pins.engines} | {runtime_wheel.name}
    assert {p.name for p in dist_dir.glob("*.whl")} == expected
    assert "vllm-0.26.0+gp.1-cp38-abi3-manylinux_2_28_x86_64.whl" in expected
    assert "sglang-0.5.17+gp.1-cp312-cp312-manylinux_2_34_x86_64.whl" in expected
    assert (dist_dir / "BUILD-REPORT.md").is_file() and (dist_dir / "build-report.json").is_file()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_metadata_is_stamped_consistently(dist_dir: Path, pins: Pins, engine: str) -> None:
    pin = pins.engine(engine)
    version = pins.dist_version(pin.version)
    with zipfile.ZipFile(engine_wheel(dist_dir, pins, engine)) as zf:
        infos = {n.split("/")[0] for n in zf.namelist() if ".dist-info/" in n}
        assert infos == {f"{pin.project}-{version}.dist-info"}
        meta = zf.read(f"{pin.project}-{version}.dist-info/METADATA").decode()
    headers = meta.partition("\n\n")[0].split("\n")
    assert f"Version: {version}" in headers
    assert f"Requires-Dist: {pins.runtime_name}=={pins.runtime_version}" in headers
    assert f"Requires-Dist: torch=={pin.requires_torch}" in headers


def _check_record(wheel: Path) -> dict[str, str]:
    with zipfile.ZipFile(wheel) as zf:
        record_name = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        record = parse_record(zf.read(record_name).decode())
        members = {n for n in zf.namelist() if not n.endswith("/")}  # directory entries carry no data
        assert set(record) == members, f"RECORD and members differ: {set(record) ^ members}"
        digests = {}
        for name, (digest, size) in record.items():
            if name == record_name:
                assert digest == "" and size == ""
                continue
            data = zf.read(name)
            raw = hashlib.sha256(data).digest()
            assert digest == "sha256=" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode(), name
            assert int(size) == len(data), name
            digests[name] = raw.hex()
    return digests


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_record_hashes_are_valid_and_native_code_is_byte_identical(dist_dir: Path, pins: Pins, engine: str) -> None:
    pin = pins.engine(engine)
    ours = _check_record(engine_wheel(dist_dir, pins, engine))
    upstream = _check_record(fetch(pin.wheel))
    old_info = WheelName.parse(pin.wheel.filename).dist_info
    new_info = WheelName.parse(pin.wheel.filename).with_version(pins.dist_version(pin.version)).dist_info
    native = [n for n in upstream if n.endswith(".so") or ".so." in n or n.endswith("vllm-rs")]
    assert native, "expected native libraries in the upstream wheel"
    for name in native:
        assert ours[name] == upstream[name], f"native file {name} changed"
    changed = sorted(
        n
        for n in upstream
        if n.replace(old_info, new_info) in ours and ours[n.replace(old_info, new_info)] != upstream[n]
    )
    assert all(n.endswith(".py") or n.startswith(old_info) for n in changed), changed
    assert f"{old_info}/METADATA" in changed


def test_runtime_wheel_record_is_valid(runtime_wheel: Path) -> None:
    digests = _check_record(runtime_wheel)
    assert "graphpersist/__init__.py" in digests and "graphpersist/cli.py" in digests


def test_runtime_wheel_carries_the_interposer_for_these_sources(runtime_wheel: Path, tmp_path: Path) -> None:
    """A serving host needs only pip: the platform wheel holds the compiled interposer, built from exactly the
    sources it ships (their digest), needing nothing newer than glibc 2.28 (its manylinux_2_28 tag)."""
    from graphpersist.memory import region

    with zipfile.ZipFile(runtime_wheel) as zf:
        names = set(zf.namelist())
        info = next(n for n in names if n.endswith(".dist-info/WHEEL"))
        assert "Root-Is-Purelib: false" in zf.read(info).decode()
        assert "Tag: py3-none-manylinux_2_28_x86_64" in zf.read(info).decode()
        lib = zf.read("graphpersist/native/prebuilt/libgpinterpose.so")
        stamp = zf.read("graphpersist/native/prebuilt/SOURCES.sha256").decode().strip()
        shipped = {n for n in names if n.startswith("graphpersist/native/") and "/prebuilt/" not in n}
    assert stamp == region.sources_digest()
    assert shipped == {f"graphpersist/native/{p.name}" for p in region.native_sources()}
    (tmp_path / "lib.so").write_bytes(lib)
    versions = _glibc_versions(tmp_path / "lib.so")
    assert versions and max(versions) <= (2, 28), versions


def _glibc_versions(lib: Path) -> set[tuple[int, ...]]:
    dyn = subprocess.run(["objdump", "-T", str(lib)], capture_output=True, text=True, check=True).stdout
    return {tuple(int(x) for x in m.split("_")[1].split(".")) for m in re.findall(r"GLIBC_[0-9.]+", dyn)}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_every_patched_python_file_compiles(dist_dir: Path, pins: Pins, engine: str) -> None:
    pin = pins.engine(engine)
    upstream = _check_record(fetch(pin.wheel))
    with zipfile.ZipFile(engine_wheel(dist_dir, pins, engine)) as zf:
        touched = [
            n for n in zf.namelist() if n.endswith(".py") and hashlib.sha256(zf.read(n)).hexdigest() != upstream.get(n)
        ]
        for name in touched:
            compile(zf.read(name), name, "exec", dont_inherit=True)
    report = (dist_dir / "build-report.json").read_text()
    for name in touched:
        assert name in report, f"{name} differs from upstream but the build report does not list it"


@pytest.mark.slow
def test_wheels_install_with_no_deps_into_a_fresh_venv(
    runtime_wheel: Path, dist_dir: Path, pins: Pins, tmp_path: Path
) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    wheels = [engine_wheel(dist_dir, pins, "vllm"), runtime_wheel]
    subprocess.run(
        [py, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--no-index", *map(str, wheels)], check=True
    )
    probe = (
        "import importlib.metadata as m; print(m.version('vllm'), m.version('graphpersist'));"
        "print(m.distribution('vllm').read_text('RECORD').count('\\n'))"
    )
    out = subprocess.run([py, "-c", probe], check=True, capture_output=True, text=True).stdout.split()
    assert out[:2] == [pins.dist_version(pins.engine("vllm").version), pins.runtime_version]
    assert int(out[2]) > 4000
    cli = env_dir / "bin" / "graphpersist"
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the installed package, not the sources
    version = subprocess.run([cli, "--version"], capture_output=True, text=True, check=True, env=clean).stdout
    assert version.startswith(f"graphpersist {pins.runtime_version} (archive format "), version
    assert "usage" in subprocess.run([cli, "--help"], capture_output=True, text=True, check=True).stdout.lower()
    # The installed runtime uses its prebuilt interposer: no compiler on PATH, nothing built.
    where = "from graphpersist import region; print(region.interposer_path())"
    lib = subprocess.run([py, "-c", where], capture_output=True, text=True, check=True, env={**clean, "PATH": ""})
    assert lib.stdout.strip() == str(
        env_dir
        / "lib"
        / f"python{sys.version_info.major}.{sys.version_info.minor}"
        / "site-packages"
        / "graphpersist"
        / "native"
        / "prebuilt"
        / "libgpinterpose.so"
    )
    # The engine's requirement on the runtime resolves (pip check lists the other, uninstalled dependencies).
    check = subprocess.run([py, "-m", "pip", "check"], capture_output=True, text=True).stdout
    assert "graphpersist" not in check, check
    # SGLang's pinned wheel is for CPython 3.12: install it for that target into a folder.
    target = tmp_path / "sglang-target"
    subprocess.run(
        [
            py,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-compile",
            "--no-index",
            "--target",
            str(target),
            "--python-version",
            "3.12",
            "--only-binary=:all:",
            str(engine_wheel(dist_dir, pins, "sglang")),
        ],
        check=True,
    )
    assert (target / f"sglang-{pins.dist_version('0.5.17')}.dist-info" / "RECORD").is_file()


@pytest.mark.slow
def test_build_is_reproducible_and_works_offline(dist_dir: Path, pins: Pins, tmp_path: Path, repo_root: Path) -> None:
    out = tmp_path / "again"
    env = {**os.environ, "GP_INDEX_URL": "http://127.0.0.1:9/unreachable", "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run(
        [sys.executable, "-m", "gpdist", "build", "--offline", "--out", str(out)], check=True, env=env, cwd=repo_root
    )
    first = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in dist_dir.glob("*.whl")}
    second = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.glob("*.whl")}
    assert first == second
    assert (dist_dir / "build-report.json").read_text() == (out / "build-report.json").read_text()


def _same_bytes(a: zipfile.ZipFile, a_name: str, b: zipfile.ZipFile, b_name: str) -> bool:
    """Member bytes compared: identical compressed payloads (the build copies unchanged members raw) decompress
    to identical bytes; anything else is decompressed and compared, streamed (vLLM's wheel holds about 1 GB)."""
    a_info, b_info = a.getinfo(a_name), b.getinfo(b_name)
    if a_info.file_size != b_info.file_size:
        return False
    if a_info.compress_type == b_info.compress_type and read_raw(a, a_info).data == read_raw(b, b_info).data:
        return True
    with a.open(a_name) as fa, b.open(b_name) as fb:
        while chunk := fa.read(1 << 20):
            if chunk != fb.read(len(chunk)):
                return False
    return True


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_wheel_differs_from_upstream_only_in_series_overlay_and_metadata_files(
    dist_dir: Path, pins: Pins, repo_root: Path, engine: str
) -> None:
    """The zip-level diff of pristine upstream vs our wheel: every member compared by name and bytes. It must
    equal what build-report.json says, and that must be the series' files + the overlay's files + dist-info
    METADATA (stamped) and RECORD (its hashes change with every changed file); nothing else may differ."""
    from gptools.series import load_series

    pin = pins.engine(engine)
    old_info = WheelName.parse(pin.wheel.filename).dist_info
    new_info = WheelName.parse(pin.wheel.filename).with_version(pins.dist_version(pin.version)).dist_info
    with zipfile.ZipFile(fetch(pin.wheel)) as up, zipfile.ZipFile(engine_wheel(dist_dir, pins, engine)) as ours:
        up_names = {n.replace(old_info, new_info, 1): n for n in up.namelist() if not n.endswith("/")}
        our_names = {n for n in ours.namelist() if not n.endswith("/")}
        only_upstream = set(up_names) - our_names
        added = our_names - set(up_names)
        changed = {n for n in our_names & set(up_names) if not _same_bytes(up, up_names[n], ours, n)}
    assert not only_upstream, f"members of upstream missing from our wheel: {sorted(only_upstream)}"

    series_files = {fd.path for patch in load_series(pin.patches_dir) for fd in patch.files}
    overlay_files = {
        p.relative_to(pin.overlay_dir).as_posix()
        for p in pin.overlay_dir.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }
    metadata = {f"{new_info}/METADATA", f"{new_info}/RECORD"}
    assert series_files and overlay_files
    assert added == overlay_files, "only the overlay adds files"
    assert changed == series_files | metadata, "only the series' files and the stamped metadata change"

    [built] = [e for e in json.loads((dist_dir / "build-report.json").read_text())["engines"] if e["engine"] == engine]
    assert set(built["patched_files"]) == series_files
    assert set(built["overlay_files"]) == overlay_files
    assert set(built["metadata_files"]) == {f"{new_info}/METADATA"}  # RECORD is rewritten last, never reported
    assert (
        set(built["patched_files"])
        | set(built["overlay_files"])
        | set(built["metadata_files"])
        | {f"{new_info}/RECORD"}
        == added | changed
    )
