"""Unit behaviour of the build steps that needs no download: wheel names, stamping, RECORD, zip writing, fetch."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from gptools_fixtures import ScratchEngine, make_series, standard_changes, upstream_files

from gpdist import __main__ as gpdist_cli
from gpdist import engine as engine_mod
from gpdist import fetch as fetch_mod
from gpdist import unpack as unpack_mod
from gpdist.engine import BuildError, _copy_overlay
from gpdist.pins import Artifact, Pins
from gpdist.wheelmeta import WheelName, parse_record, record_digest, render_record, stamp_metadata
from gpdist.wheelzip import ReproducibleZip, read_raw

METADATA = (
    "Metadata-Version: 2.1\nName: demo\nVersion: 1.0\nRequires-Dist: a>=1\nRequires-Dist: b; extra == 'x'\n\nbody\n"
)


def test_wheel_name_keeps_tags_and_stamps_version() -> None:
    name = WheelName.parse("vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl").with_version("0.26.0+gp.1")
    assert name.filename == "vllm-0.26.0+gp.1-cp38-abi3-manylinux_2_28_x86_64.whl"
    assert name.dist_info == "vllm-0.26.0+gp.1.dist-info"
    with pytest.raises(ValueError):
        WheelName.parse("vllm-0.26.0.tar.gz")


def test_stamp_metadata_sets_version_and_adds_requirement_after_the_others() -> None:
    out = stamp_metadata(METADATA, "1.0+gp.1", "graphpersist==1")
    head, _, body = out.partition("\n\n")
    assert "Version: 1.0+gp.1" in head.split("\n")
    assert head.split("\n")[-1] == "Requires-Dist: graphpersist==1"
    assert body == "body\n"
    with pytest.raises(ValueError, match="already requires"):
        stamp_metadata(out, "1.0+gp.1", "graphpersist==1")


def test_record_round_trip() -> None:
    rows = [("a/b.py", record_digest(b"x"), "1"), ("d-1.dist-info/RECORD", "", "")]
    parsed = parse_record(render_record(rows).decode())
    assert parsed["a/b.py"] == (record_digest(b"x"), "1")
    assert record_digest(b"x").startswith("sha256=") and "=" not in record_digest(b"x")[7:]


def test_reproducible_zip_copies_raw_members_and_is_deterministic(tmp_path: Path) -> None:
    src = tmp_path / "src.zip"
    with zipfile.ZipFile(src, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("lib.so", b"\x7fELF" + bytes(range(256)) * 100)
    outs = []
    for name in ("one.zip", "two.zip"):
        out = tmp_path / name
        with zipfile.ZipFile(src) as zsrc, ReproducibleZip(out, 1795996800) as zout:
            zout.add_raw("pkg/lib.so", read_raw(zsrc, zsrc.getinfo("lib.so")), executable=True)
            zout.add_bytes("pkg/mod.py", b"print('hi')\n")
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    with zipfile.ZipFile(tmp_path / "one.zip") as zf:
        assert zf.testzip() is None
        assert zf.read("pkg/lib.so") == b"\x7fELF" + bytes(range(256)) * 100
        info = zf.getinfo("pkg/lib.so")
        assert (info.external_attr >> 16) & 0o777 == 0o755
        assert info.date_time == (2026, 11, 30, 0, 0, 0)


def test_overlay_may_not_replace_an_upstream_file(tmp_path: Path) -> None:
    tree, overlay = tmp_path / "tree", tmp_path / "overlay"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "engine.py").write_text("upstream\n")
    (overlay / "pkg").mkdir(parents=True)
    (overlay / "pkg" / "glue.py").write_text("ours\n")
    assert _copy_overlay(tree, overlay) == ["pkg/glue.py"]
    (overlay / "pkg" / "engine.py").write_text("ours\n")
    with pytest.raises(BuildError, match="would replace an upstream file"):
        _copy_overlay(tree, overlay)


def _artifact(data: bytes) -> Artifact:
    return Artifact(project="demo", filename="demo-1.0-py3-none-any.whl", sha256=hashlib.sha256(data).hexdigest())


def _fake_index(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, served: bytes, advertised: str) -> list[str]:
    monkeypatch.setenv("GP_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[str] = []
    monkeypatch.setattr(fetch_mod, "resolve_url", lambda project, filename: ("file://demo", advertised))

    def download(url: str, dest: Path, label: str) -> None:
        calls.append(url)
        dest.write_bytes(served)

    monkeypatch.setattr(fetch_mod, "_download", download)
    return calls


def test_fetch_verifies_and_caches_by_hash(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    good = b"good wheel"
    art = _artifact(good)
    calls = _fake_index(monkeypatch, tmp_path, good, art.sha256)
    path = fetch_mod.fetch(art)
    assert path.read_bytes() == good and path.parent.name == art.sha256
    fetch_mod.fetch(art)
    assert len(calls) == 1, "a warm cache must not download again"
    assert fetch_mod.fetch(art, offline=True) == path


def test_fetch_deletes_and_refuses_a_download_with_the_wrong_hash(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    art = _artifact(b"expected")
    _fake_index(monkeypatch, tmp_path, b"tampered", art.sha256)
    with pytest.raises(fetch_mod.FetchError, match="sha256 mismatch") as err:
        fetch_mod.fetch(art)
    assert art.sha256 in str(err.value)
    assert not fetch_mod.cached_path(art).exists()


def test_fetch_refuses_when_the_index_advertises_another_hash(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    art = _artifact(b"expected")
    calls = _fake_index(monkeypatch, tmp_path, b"expected", "0" * 64)
    with pytest.raises(fetch_mod.FetchError, match="refusing to download"):
        fetch_mod.fetch(art)
    assert calls == []


def test_fetch_replaces_a_corrupted_cache_entry_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    art = _artifact(b"expected")
    calls = _fake_index(monkeypatch, tmp_path, b"expected", art.sha256)
    cached = fetch_mod.cached_path(art)
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"bit rot")
    assert fetch_mod.fetch(art).read_bytes() == b"expected"
    assert len(calls) == 1
    err = capsys.readouterr().err
    rot = hashlib.sha256(b"bit rot").hexdigest()
    said = [line for line in err.splitlines() if "failed its sha256" in line]
    failed = f"cached {art.filename} failed its sha256 (expected {art.sha256}, got {rot})"
    assert said == [f"gpdist: {failed}; deleted it, fetching again"]


def test_offline_fetch_of_a_tampered_cache_says_once_that_it_will_not_fetch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    art = _artifact(b"expected")
    calls = _fake_index(monkeypatch, tmp_path, b"expected", art.sha256)
    cached = fetch_mod.cached_path(art)
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"bit rot")
    with pytest.raises(fetch_mod.FetchError) as err:
        fetch_mod.fetch(art, offline=True)
    rot = hashlib.sha256(b"bit rot").hexdigest()
    assert str(err.value) == (
        f"cached {art.filename} failed its sha256 (expected {art.sha256}, got {rot}); "
        f"not fetching again because --offline: delete {cached} or build online"
    )
    assert capsys.readouterr().err == "", "offline: the error is the only message, nothing says 'fetching again'"
    assert calls == [] and cached.read_bytes() == b"bit rot", "offline leaves the cache as it found it"


def test_offline_build_with_a_tampered_cache_prints_one_error_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str], pins: Pins
) -> None:
    """The real command line and the real pin: the user sees one line that says what happened and what to do."""
    monkeypatch.setenv("GP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("GP_INDEX_URL", "http://127.0.0.1:9/unreachable")
    art = pins.engine("sglang").wheel
    cached = fetch_mod.cached_path(art)
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"tampered")
    assert gpdist_cli.main(["build", "--engine", "sglang", "--offline", "--out", str(tmp_path / "dist")]) == 1
    lines = capsys.readouterr().err.splitlines()
    [error] = [line for line in lines if art.filename in line]
    assert error.startswith(f"gpdist: error: cached {art.filename} failed its sha256 (expected {art.sha256}, got ")
    assert error.endswith(
        "not fetching again because --offline: delete it or build online".replace("it", str(cached), 1)
    )
    assert not any("fetching again;" in line or "downloading" in line for line in lines)


def _scratch_wheel(path: Path, files: dict[str, str]) -> Artifact:
    """A small upstream wheel with a valid RECORD (what build_engine checks the output against)."""
    info = "fakepkg-1.0.0.dist-info"
    members = {**files, f"{info}/METADATA": "Metadata-Version: 2.1\nName: fakepkg\nVersion: 1.0.0\n\n"}
    rows = [(rel, record_digest(text.encode()), str(len(text.encode()))) for rel, text in sorted(members.items())]
    with zipfile.ZipFile(path, "w") as zf:
        for rel, text in sorted(members.items()):
            zf.writestr(rel, text)
        zf.writestr(f"{info}/RECORD", render_record([*rows, (f"{info}/RECORD", "", "")]))
    return Artifact("fakepkg", path.name, hashlib.sha256(path.read_bytes()).hexdigest())


def test_a_first_build_hashes_the_upstream_wheel_once_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str], pins: Pins
) -> None:
    """A first build (cached wheel, no unpacked tree yet) verifies the wheel once and uses that copy throughout."""
    series = make_series(tmp_path, upstream_files(), standard_changes())
    monkeypatch.setenv("GP_CACHE_DIR", str(tmp_path / "cache"))
    art = _scratch_wheel(tmp_path / "fakepkg-1.0.0-py3-none-any.whl", upstream_files())
    cached = fetch_mod.cached_path(art)
    cached.parent.mkdir(parents=True)
    cached.write_bytes((tmp_path / art.filename).read_bytes())
    engine = ScratchEngine("fakepkg", "fakepkg", "1.0.0", art, None, "", "", "2.11.0", root=series.patches_dir.parent)
    for module in (unpack_mod, engine_mod):
        monkeypatch.setattr(module, "WORK_DIR", tmp_path / "work")
    hashed: list[Path] = []
    real_sha256_file = fetch_mod.sha256_file

    def counting_sha256_file(path: Path) -> str:
        hashed.append(Path(path))
        return real_sha256_file(path)

    for module in (fetch_mod, engine_mod):
        monkeypatch.setattr(module, "sha256_file", counting_sha256_file)

    build = engine_mod.build_engine(pins, engine, tmp_path / "dist")
    assert build.wheel.is_file() and build.patches == series.names
    assert hashed.count(cached) == 1, f"the upstream wheel was hashed {hashed.count(cached)} times"
    assert len(hashed) == len(set(hashed)), "every file is hashed once per build"
    said = [line for line in capsys.readouterr().err.splitlines() if "sha256 verified" in line]
    assert said == [f"gpdist: using cached {art.filename} (sha256 verified)"]


@pytest.mark.parametrize("command", ["build", "fetch"])
def test_gpdist_help_explains_engine_offline_and_the_cache(command: str, repo_root: Path) -> None:
    env = {"PYTHONPATH": f"{repo_root / 'build'}:{repo_root / 'tools'}", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-m", "gpdist", command, "--help"], capture_output=True, text=True, env=env, cwd=repo_root
    )
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "--engine {all,vllm,sglang,deep_ep} " in text and "one of vllm, sglang, deep_ep, or all (default)" in text
    assert "GP_CACHE_DIR" in text and "~/.cache/graphpersist-dist" in text and "GP_INDEX_URL" in text
    assert "never download" in text


def test_offline_fetch_of_an_uncached_file_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GP_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(fetch_mod.FetchError, match="not in the cache"):
        fetch_mod.fetch(_artifact(b"x"), offline=True)


def test_unpack_keeps_modes_replaces_old_trees_and_refuses_escaping_members(tmp_path: Path) -> None:
    from gpdist.unpack import MARKER, tree_files, unpack_wheel

    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        script = zipfile.ZipInfo("demo/run.sh")
        script.external_attr = 0o100755 << 16
        zf.writestr(script, "#!/bin/sh\n")
        zf.writestr("demo/__init__.py", "")
    dest = tmp_path / "tree"
    (dest / "stale").mkdir(parents=True)
    unpack_wheel(wheel, dest, marker="abc")
    assert tree_files(dest) == ["demo/__init__.py", "demo/run.sh"]
    assert (dest / "demo" / "run.sh").stat().st_mode & 0o777 == 0o755
    assert (dest / MARKER).read_text() == "abc"
    assert not list(tmp_path.glob("tree.*")), "no temporary trees may be left behind"

    evil = tmp_path / "evil-1.0-py3-none-any.whl"
    with zipfile.ZipFile(evil, "w") as zf:
        zf.writestr("../outside.py", "")
    with pytest.raises(RuntimeError, match="escapes the tree"):
        unpack_wheel(evil, tmp_path / "evil")
    assert not (tmp_path / "outside.py").exists()


def test_a_failed_transfer_is_one_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    art = _artifact(b"expected")
    _fake_index(monkeypatch, tmp_path, b"", art.sha256)

    def broken(url: str, dest: Path, label: str) -> None:
        raise ConnectionResetError("connection reset by peer")

    monkeypatch.setattr(fetch_mod, "_download", broken)
    with pytest.raises(fetch_mod.FetchError, match=r"downloading demo-1\.0-py3-none-any\.whl failed"):
        fetch_mod.fetch(art)


def test_a_download_of_the_wrong_size_is_deleted_and_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    data = b"expected"
    art = Artifact(project="demo", filename="demo-1.0-py3-none-any.whl", sha256=_artifact(data).sha256, size=99)
    _fake_index(monkeypatch, tmp_path, data, art.sha256)
    with pytest.raises(fetch_mod.FetchError, match="size 8 != pinned 99"):
        fetch_mod.fetch(art)
    assert not fetch_mod.cached_path(art).exists()
