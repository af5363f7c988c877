"""What the build, rebase and bundle tools learned for a third package (deep_ep), checked without a download.

A pin may rename the distribution (tokenspeed-deepep -> deep_ep), pin one wheel per Python (`other_wheels`, each
built with the same series and overlay), and be a library the engines import (kind = "library": no bundle of its
own). Our wheels require the torch their native code was checked against when upstream declares none.
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

import pytest
from gptools_fixtures import ScratchEngine, make_series, standard_changes, upstream_files

from gpdist import engine as engine_mod
from gpdist import fetch as fetch_mod
from gpdist import pins as pins_mod
from gpdist import unpack as unpack_mod
from gpdist.pins import Artifact, Pins
from gpdist.wheelmeta import parse_record, requires, stamp_metadata
from gptools import rebase as rebase_mod
from gptools.rebase import NewWheel, RebaseError, update_pins, update_pins_text

UPSTREAM_METADATA = (
    "Metadata-Version: 2.1\nName: tokenspeed-deepep\nVersion: 1.2.1.post20251110\nLicense-File: LICENSE\n\n"
)


def test_stamp_metadata_renames_the_distribution_and_adds_each_requirement() -> None:
    out = stamp_metadata(
        UPSTREAM_METADATA, "1.2.1.post20251110+gp.1", ["graphpersist==1", "torch==2.11.0"], name="deep_ep"
    )
    assert out == (
        "Metadata-Version: 2.1\nName: deep_ep\nVersion: 1.2.1.post20251110+gp.1\nLicense-File: LICENSE\n"
        "Requires-Dist: graphpersist==1\nRequires-Dist: torch==2.11.0\n\n"
    )
    with pytest.raises(ValueError, match="already requires torch"):
        stamp_metadata(out, "1", "torch==2.11.0")
    assert stamp_metadata("Name: a\nVersion: 1\n", "2", "x==1") == "Name: a\nVersion: 2\nRequires-Dist: x==1\n"


@pytest.mark.parametrize(
    ("line", "found"),
    [
        ("Requires-Dist: torch==2.11.0", True),
        ("Requires-Dist: Torch (==2.11.0)", True),
        ("Requires-Dist: torch; extra == 'gpu'", True),
        ("Requires-Dist: torchvision==0.26", False),
        ("Requires-Dist: flash_attn", False),
    ],
)
def test_requires_knows_a_requirement_by_its_normalised_name(line: str, found: bool) -> None:
    assert requires(f"Name: x\n{line}\n\nRequires-Dist: torch (in the body)\n", "torch") is found
    assert requires("Name: x\nRequires-Dist: Flash-Attn>=2\n", "flash_attn")


def _wheel(cache: Path, tag: str, native: bytes) -> Artifact:
    """A renamed-upstream-style wheel (fake_up) for one Python, placed in the sha256-keyed cache."""
    filename = f"fake_up-1.0-{tag}-{tag}-manylinux_2_28_x86_64.whl"
    info = "fake_up-1.0.dist-info"
    files = {**{k: v.encode() for k, v in upstream_files().items()}, f"fake_up_cpp.{tag}.so": native}
    files[f"{info}/METADATA"] = b"Metadata-Version: 2.1\nName: fake-up\nVersion: 1.0\n\n"
    rows = [f"{n},sha256={_b64(hashlib.sha256(d).digest())},{len(d)}" for n, d in sorted(files.items())]
    staging = cache / filename
    with zipfile.ZipFile(staging, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in sorted(files.items()):
            zf.writestr(name, data)
        zf.writestr(f"{info}/RECORD", "\n".join([*rows, f"{info}/RECORD,,"]) + "\n")
    art = Artifact("fake-up", filename, hashlib.sha256(staging.read_bytes()).hexdigest(), staging.stat().st_size)
    cached = fetch_mod.cached_path(art)
    cached.parent.mkdir(parents=True)
    staging.replace(cached)
    return art


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def test_a_renamed_package_with_a_wheel_per_python_builds_one_wheel_each(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, pins: Pins
) -> None:
    monkeypatch.setenv("GP_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    for module in (unpack_mod, engine_mod):
        monkeypatch.setattr(module, "WORK_DIR", tmp_path / "work")
    series = make_series(tmp_path, upstream_files(), standard_changes())
    (tmp_path / "overlay" / "fakepkg").mkdir(parents=True)
    (tmp_path / "overlay" / "fakepkg" / "glue.py").write_text("GLUE = 1\n")
    primary = _wheel(tmp_path / "cache", "cp312", b"\x7fELF-312")
    other = _wheel(tmp_path / "cache", "cp310", b"\x7fELF-310")
    pin = ScratchEngine(
        "fake", "fake-up", "1.0", primary, None, "", "", "2.11.0", "renamed", (other,), pins_mod.LIBRARY,
        root=series.patches_dir.parent,
    )  # fmt: skip

    builds = engine_mod.build_engine_wheels(pins, pin, tmp_path / "dist")

    assert [b.wheel.name for b in builds] == [
        "renamed-1.0+gp.1-cp312-cp312-manylinux_2_28_x86_64.whl",
        "renamed-1.0+gp.1-cp310-cp310-manylinux_2_28_x86_64.whl",
    ]
    for build, native in zip(builds, (b"\x7fELF-312", b"\x7fELF-310"), strict=True):
        assert build.patches == series.names and build.overlay_files == ["fakepkg/glue.py"]
        with zipfile.ZipFile(build.wheel) as zf:
            names = zf.namelist()
            assert {n.split("/")[0] for n in names if ".dist-info/" in n} == {"renamed-1.0+gp.1.dist-info"}
            meta = zf.read("renamed-1.0+gp.1.dist-info/METADATA").decode()
            record = parse_record(zf.read("renamed-1.0+gp.1.dist-info/RECORD").decode())
            assert set(record) == set(names)
            assert [n for n in names if n.endswith(".so")] == [f"fake_up_cpp.{build.upstream_wheel.split('-')[2]}.so"]
            assert zf.read(next(n for n in names if n.endswith(".so"))) == native
        assert meta.split("\n")[:5] == [
            "Metadata-Version: 2.1",
            "Name: renamed",
            "Version: 1.0+gp.1",
            "Requires-Dist: graphpersist==1",
            "Requires-Dist: torch==2.11.0",
        ]
        assert len(build.native_files) == 1


# ------------------------------------------------------------------------------------------------------------ rebase


def _new(filename: str, n: int) -> NewWheel:
    return NewWheel(filename, Path(filename), f"{n:x}" * 64, 1000 + n)


def test_a_rebase_re_pins_every_python_of_deep_ep_and_nothing_else(repo_root: Path, tmp_path: Path) -> None:
    real = (repo_root / "build/pins.toml").read_text()
    wheel = _new("tokenspeed_deepep-2.0.0-cp312-cp312-manylinux_2_28_x86_64.whl", 2)
    tags = ((0, "cp310"), (1, "cp311"), (3, "cp313"))
    others = [_new(f"tokenspeed_deepep-2.0.0-{t}-{t}-manylinux_2_28_x86_64.whl", i) for i, t in tags]
    new = update_pins_text(real, "deep_ep", version="2.0.0", wheel=wheel, commit="", torch="", other_wheels=others)
    copy = tmp_path / "pins.toml"
    copy.write_text(new)
    loaded, before = pins_mod.load(copy), pins_mod.load(repo_root / "build/pins.toml")
    pin = loaded.engine("deep_ep")
    assert (pin.version, pin.wheel.filename, pin.wheel.sha256, pin.wheel.size) == (
        "2.0.0",
        wheel.filename,
        "2" * 64,
        1002,
    )
    assert [(a.filename, a.sha256, a.size) for a in pin.other_wheels] == [
        (w.filename, w.sha256, w.size) for w in others
    ]
    assert (pin.dist_name, pin.kind, pin.requires_torch) == ("deep_ep", "library", "2.11.0")
    for name in ("vllm", "sglang"):
        assert loaded.engine(name) == before.engine(name)
    assert (loaded.dependencies, loaded.verify) == (before.dependencies, before.verify)
    assert "# The same release for the other Pythons it exists for" in new


def test_a_same_version_re_pin_of_deep_ep_rewrites_nothing(repo_root: Path, pins: Pins) -> None:
    """The control run of `make rebase ENGINE=deep_ep VERSION=<the pinned one>`: the pins file stays byte-identical."""
    real = (repo_root / "build/pins.toml").read_text()
    pin = pins.engine("deep_ep")
    as_new = [NewWheel(a.filename, Path(a.filename), a.sha256, a.size or 0) for a in pin.wheels]
    again = update_pins_text(
        real, "deep_ep", version=pin.version, wheel=as_new[0], commit="", torch="", other_wheels=as_new[1:]
    )
    assert again == real


def test_a_re_pin_never_leaves_the_other_pythons_at_the_old_release(repo_root: Path, tmp_path: Path) -> None:
    copy = tmp_path / "pins.toml"
    copy.write_text((repo_root / "build/pins.toml").read_text())
    wheel = _new("tokenspeed_deepep-2.0.0-cp312-cp312-manylinux_2_28_x86_64.whl", 2)
    with pytest.raises(RebaseError, match="pins wheels for other Pythons too"):
        update_pins(copy, "deep_ep", version="2.0.0", wheel=wheel, commit="", torch="")
    assert copy.read_text() == (repo_root / "build/pins.toml").read_text()


def test_a_new_release_without_one_of_the_pinned_pythons_is_named(monkeypatch: pytest.MonkeyPatch, pins: Pins) -> None:
    listing = [f"tokenspeed_deepep-2.0.0-{t}-{t}-manylinux_2_28_x86_64.whl" for t in ("cp311", "cp312", "cp313")]
    monkeypatch.setattr(rebase_mod, "list_index", lambda project: listing)
    with pytest.raises(RebaseError, match=r"no wheel for version 2\.0\.0 with tags cp310-cp310-\*x86_64"):
        rebase_mod.fetch_other_wheels(pins.engine("deep_ep"), "2.0.0")


# ------------------------------------------------------------------------------------------------------ pins, bundle


def test_deep_ep_is_built_and_checked_like_an_engine_but_bundled_with_none(pins: Pins) -> None:
    from gptools import bundle
    from gptools.series import engines_arg

    assert "deep_ep" in engines_arg("all"), "make build / check / hooks cover it"
    assert bundle.SERVING == pins.serving_engines == ("vllm", "sglang")


def test_an_unknown_kind_is_refused_naming_the_table(repo_root: Path, tmp_path: Path) -> None:
    copy = tmp_path / "pins.toml"
    copy.write_text((repo_root / "build/pins.toml").read_text().replace('kind = "library"', 'kind = "plugin"'))
    with pytest.raises(SystemExit, match=r"\[engines\.deep_ep\] kind = 'plugin': use one of engine, library"):
        pins_mod.load(copy)
