"""`gptools bundle --lock` / `--write-lock` and `make bundle`: a bundle made from a committed lock brings exactly the
locked files, whatever the index publishes later, and refuses any file whose sha256 is not the lock's.

The index is a fake one on 127.0.0.1 (bundle_fixtures.fake_index) serving a folder of wheels made in the test; the
download cache is a temporary GP_CACHE_DIR. No network except the test marked `network`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from bundle_fixtures import FakeIndex, fake_index, make_wheel

from gpdist import fetch as gpfetch
from gptools import bundle
from gptools import bundle_archive as ba
from gptools import bundle_closure as bc
from gptools import bundle_lock as bl

REPO = Path(__file__).resolve().parents[2]
GPU_HOST = REPO / "recipes" / "gpu-host"
UNREACHABLE = "http://127.0.0.1:9/no-index-here"


@dataclass
class Scene:
    tmp: Path
    dist: Path
    house: Path  # what the index serves (and the resolver's --wheelhouse)
    index: FakeIndex
    lock: Path
    base: list[str]  # the options both verbs share

    def write_lock(self, *extra: str) -> int:
        return bundle.main([*self.base, "--wheelhouse", str(self.house), "--write-lock", str(self.lock), *extra])

    def bundle(self, *extra: str) -> int:
        return bundle.main([*self.base, "--lock", str(self.lock), *extra])

    @property
    def out(self) -> Path:
        return self.tmp / "bundle" / "vllm"

    def manifest(self) -> dict:
        return json.loads((self.out / "manifest.json").read_text())


@pytest.fixture
def scene(tmp_path, monkeypatch):
    """dist/ with a fake vllm and graphpersist; an index serving tinydep 1.2; a host freeze; an empty cache."""
    dist = tmp_path / "dist"
    make_wheel(dist, "vllm", "0.26.0+gp.1", ["graphpersist==1", "tinydep>=1", "numpy"])
    make_wheel(dist, "graphpersist", "1")
    house = tmp_path / "house"
    make_wheel(house, "tinydep", "1.2", files={"tinydep/__init__.py": "VALUE = 42\n"})
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("numpy==2.5.2\n")
    monkeypatch.setenv("GP_CACHE_DIR", str(tmp_path / "cache"))
    base = ["bundle", "--dist", str(dist), "--engine", "vllm", "--host-freeze", str(freeze)]
    base += ["--out", str(tmp_path / "bundle"), "--part-size", "64KiB"]
    with fake_index(house) as index:
        monkeypatch.setattr(gpfetch, "INDEX_URL", index.url + "/simple")
        yield Scene(tmp_path, dist, house, index, tmp_path / "vllm.lock", base)


def locked_wheels(lock: bl.Lock) -> list[tuple[str, str, str]]:
    return [(w.name, w.version, w.sha256) for w in lock.wheels if not w.from_dist]


def bundled_wheels(manifest: dict) -> list[tuple[str, str, str]]:
    return [(w["name"], w["version"], w["sha256"]) for w in manifest["wheels"] if w["source"] != bc.DIST]


def test_write_lock_records_every_wheel_by_name_version_and_sha256(scene):
    assert scene.write_lock() == 0
    lock = bl.load(scene.lock)
    tiny = scene.house / "tinydep-1.2-py3-none-any.whl"
    assert locked_wheels(lock) == [("tinydep", "1.2", ba.sha256_file(tiny))]
    [entry] = [w for w in lock.wheels if not w.from_dist]
    assert (entry.file, entry.size, entry.source) == (tiny.name, tiny.stat().st_size, bc.DOWNLOADED)
    # ours are locked by name and version: their sha256 is this commit's build output
    assert {(w.name, w.version, w.sha256) for w in lock.wheels if w.from_dist} == {
        ("vllm", "0.26.0+gp.1", ""),
        ("graphpersist", "1", ""),
    }
    assert [(h.name, h.source) for h in lock.not_bundled] == [("numpy", bc.HOST)]
    assert lock.inputs.host_freeze_sha256 == ba.sha256_file(scene.tmp / "freeze.txt")
    assert bl.load(scene.lock) == lock and bl.render(lock) == scene.lock.read_text()  # it reads back as written
    assert not (scene.out / "manifest.json").exists()  # a lock, no bundle
    assert ba.sha256_file(bl.cached_path(entry)) == entry.sha256  # seeded: the bundle after it downloads nothing


def test_bundle_from_the_lock_ignores_a_newer_version_on_the_index(scene, monkeypatch, capsys):
    assert scene.write_lock() == 0
    make_wheel(scene.house, "tinydep", "1.3")  # a release on the index since the lock
    capsys.readouterr()
    assert scene.write_lock("--dry-run", "--json") == 0  # what resolving today would take
    assert [w["version"] for w in json.loads(capsys.readouterr().out)[0]["wheels"] if w["name"] == "tinydep"] == ["1.3"]

    def no_resolution(*args, **kwargs):
        raise AssertionError("the lock path resolved against the index")

    monkeypatch.setattr(bc, "resolve", no_resolution)
    monkeypatch.setenv("GP_CACHE_DIR", str(scene.tmp / "cold-cache"))  # so the locked file is downloaded
    scene.index.requests.clear()
    assert scene.bundle() == 0
    lock = bl.load(scene.lock)
    assert bundled_wheels(scene.manifest()) == locked_wheels(lock)
    assert [w["name"] for w in scene.manifest()["wheels"]] == [w.name for w in lock.wheels]
    assert "/files/tinydep-1.2-py3-none-any.whl" in scene.index.requests
    assert not any("1.3" in r for r in scene.index.requests)
    assert f"tinydep==1.2 --hash=sha256:{locked_wheels(lock)[0][2]}" in (scene.out / "requirements.lock").read_text()
    assert ba.verify_bundle(scene.out).ok


def test_bundle_from_a_warm_cache_never_touches_the_index(scene, monkeypatch, capsys):
    assert scene.write_lock() == 0
    make_wheel(scene.house, "tinydep", "1.3")
    monkeypatch.setattr(gpfetch, "INDEX_URL", UNREACHABLE)
    assert scene.bundle("--offline") == 0
    assert bundled_wheels(scene.manifest()) == locked_wheels(bl.load(scene.lock))
    # a cold cache with --offline names the missing file instead of downloading it
    monkeypatch.setenv("GP_CACHE_DIR", str(scene.tmp / "cold-cache"))
    assert scene.bundle("--offline") == 1
    assert "tinydep-1.2-py3-none-any.whl: not in the cache" in capsys.readouterr().err


def test_a_cached_file_whose_sha256_differs_fails_closed_naming_it(scene, capsys):
    assert scene.write_lock() == 0
    assert scene.bundle() == 0
    [entry] = [w for w in bl.load(scene.lock).wheels if not w.from_dist]
    cached = bl.cached_path(entry)
    cached.write_bytes(cached.read_bytes() + b"tampered")
    got = ba.sha256_file(cached)
    capsys.readouterr()
    assert scene.bundle() == 1
    err = capsys.readouterr().err
    assert f"{entry.file}: cached copy {cached} has sha256 {got}, the lock says {entry.sha256}" in err
    assert "refusing to bundle" in err
    assert not (scene.out / "manifest.json").exists() and not list(scene.out.glob("*.part*"))  # the old one is gone
    assert ba.sha256_file(cached) == got  # refused, not silently replaced


def test_a_download_whose_sha256_differs_fails_closed_and_is_not_cached(scene, monkeypatch, capsys):
    assert scene.write_lock() == 0
    [entry] = [w for w in bl.load(scene.lock).wheels if not w.from_dist]
    monkeypatch.setenv("GP_CACHE_DIR", str(scene.tmp / "cold-cache"))
    scene.index.served[entry.file] = b"not the locked wheel"
    assert scene.bundle() == 1
    err = capsys.readouterr().err
    got = re.search(rf"{re.escape(entry.file)}: downloaded sha256 ([0-9a-f]{{64}}), the lock says {entry.sha256}", err)
    assert got is not None and got.group(1) != entry.sha256, err
    assert not bl.cached_path(entry).exists()
    # an index that advertises another sha256 is refused before anything is downloaded
    bad = "ab" * 32
    scene.index.advertised[entry.file] = bad
    scene.index.requests.clear()
    assert scene.bundle() == 1
    assert f"{entry.file}: the index advertises sha256 {bad}, the lock says {entry.sha256}" in capsys.readouterr().err
    assert not any(r.startswith("/files/") for r in scene.index.requests)


def test_a_lock_made_from_other_inputs_is_refused_line_by_line(scene, capsys):
    assert scene.write_lock() == 0
    freeze = scene.tmp / "freeze.txt"
    old_freeze = ba.sha256_file(freeze)
    freeze.write_text("numpy==2.5.2\ntorch==2.11.0\n")
    capsys.readouterr()
    assert scene.bundle("--exclude", "tinydep=not needed", "--prefer", "tinydep==1.2") == 1
    err = capsys.readouterr().err
    assert "gptools bundle: exclude: locked [], live [tinydep]" in err
    assert "gptools bundle: prefer: locked [], live [tinydep==1.2]" in err
    assert f"gptools bundle: host_freeze_sha256: locked {old_freeze}, live {ba.sha256_file(freeze)}" in err
    assert "refresh it with `make bundle-lock ENGINE=vllm`" in err
    # a rebased engine in dist/ is a different version than the lock's
    (scene.dist / "vllm-0.26.0+gp.1-py3-none-any.whl").unlink()
    make_wheel(scene.dist, "vllm", "0.27.0+gp.1", ["graphpersist==1", "tinydep>=1", "numpy"])
    assert scene.bundle() == 1
    assert f"vllm: locked 0.26.0+gp.1, {scene.dist}/ has vllm-0.27.0+gp.1-py3-none-any.whl" in capsys.readouterr().err


def test_write_lock_refuses_a_file_the_index_does_not_serve(scene, capsys):
    """A wheel the resolver found elsewhere (here a --wheelhouse; on this machine pip's find-links) could not be
    downloaded by a bundle from the lock: the lock is not written."""
    house = scene.tmp / "elsewhere"
    make_wheel(house, "tinydep", "1.2", files={"tinydep/__init__.py": "VALUE = 42\n"})
    make_wheel(house, "localonly", "1.0")
    assert bundle.main([*scene.base, "--wheelhouse", str(house), "--write-lock", str(scene.lock),
                        "--require", "localonly==1.0=test"]) == 1  # fmt: skip
    assert "localonly-1.0-py3-none-any.whl: the index lists no file" in capsys.readouterr().err
    assert not scene.lock.exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--lock", "x.lock", "--write-lock", "y.lock"], "give one of them"),
        (["--lock", "x.lock", "--wheelhouse", "w"], "--lock names the files"),
        (["--offline"], "--offline needs --lock"),
    ],
)
def test_lock_option_misuse_exits_2(scene, capsys, extra, message):
    assert bundle.main([*scene.base, *extra]) == 2
    assert message in capsys.readouterr().err
    i = scene.base.index("--engine")
    assert bundle.main([*scene.base[:i], "--engine", "all", *scene.base[i + 2 :], "--lock", "x.lock"]) == 2


# --------------------------------------------------------------------------------------------------------------------
# the committed locks


def _recipe_args(engine: str):
    parser = bundle._ArgFileParser(fromfile_prefix_chars="@")
    bundle.add_arguments(parser)
    return parser.parse_args([f"@{GPU_HOST / f'{engine}.args'}", "--host-freeze", str(GPU_HOST / "pip-freeze.txt")])


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_committed_lock_fits_its_options_file_and_the_host_freeze(engine):
    """An edit of <engine>.args or pip-freeze.txt without `make bundle-lock` would make `make bundle` refuse."""
    args = _recipe_args(engine)
    target = bc.Target(python_version="3.12", python_full_version=args.python_version, glibc=args.glibc)
    lock = bl.load(GPU_HOST / f"{engine}.lock")
    assert lock.engine == engine
    assert lock.inputs.differences(bundle._options(args).inputs(args, target)) == []


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_committed_lock_names_each_index_wheel_by_file_and_sha256(engine):
    from packaging.utils import canonicalize_name, parse_wheel_filename

    lock = bl.load(GPU_HOST / f"{engine}.lock")
    names = [w.name for w in lock.wheels]
    assert names == sorted(set(names))
    assert {w.name for w in lock.wheels if w.from_dist} >= {engine, "graphpersist"}
    for w in lock.wheels:
        if w.from_dist:
            continue
        name, version, _, _ = parse_wheel_filename(w.file)
        assert (canonicalize_name(name), str(version)) == (w.name, w.version), w.file
        assert re.fullmatch(r"[0-9a-f]{64}", w.sha256) and w.size > 0, w.file
    if engine == "sglang":
        assert "deep-ep" in {w.name for w in lock.wheels if w.from_dist}  # --with-library: our build, from dist/


# --------------------------------------------------------------------------------------------------------------------
# make bundle


def test_make_bundle_of_one_engine_builds_every_engine_and_bundles_from_its_lock():
    proc = subprocess.run(
        ["make", "-n", "-C", str(REPO), "bundle", "ENGINE=sglang"], capture_output=True, text=True, check=True
    )
    lines = proc.stdout.splitlines()
    assert any("gpdist build --engine all" in ln for ln in lines), proc.stdout
    [bundle_line] = [ln for ln in lines if "gptools bundle" in ln]
    assert "@recipes/gpu-host/sglang.args --lock recipes/gpu-host/sglang.lock" in bundle_line
    assert "--host-freeze recipes/gpu-host/pip-freeze.txt" in bundle_line and "vllm" not in bundle_line


@pytest.mark.slow
@pytest.mark.network
def test_make_bundle_for_sglang_keeps_the_other_wheels_in_dist(tmp_path):
    """Before: `make bundle ENGINE=sglang` rebuilt dist/ with SGLang's wheel alone, then wanted deep_ep."""
    dist = tmp_path / "dist"
    foreign = make_wheel(dist, "someone-else", "1.0")
    proc = subprocess.run(
        ["make", "-C", str(REPO), "bundle", "ENGINE=sglang", f"DIST={dist}", "BUNDLE_ARGS=--dry-run"],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("MAKE")},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    names = {p.name.split("-")[0] for p in dist.glob("*.whl")}
    assert {"vllm", "sglang", "deep_ep", "graphpersist"} <= names and foreign.exists()
    assert "== sglang bundle: dry-run" in proc.stdout
