"""`gptools bundle`: closure decisions, parts and their verification, install.sh, transfer trimming.

Everything here runs on small wheels generated in the test (no network): dependency wheels come from a local
wheelhouse folder (--wheelhouse) instead of `pip download`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from bundle_fixtures import make_wheel

from gptools import bundle
from gptools import bundle_archive as ba
from gptools import bundle_closure as bc

TARGET = bc.Target(python_version="3.12", python_full_version="3.12.3", glibc="2.39")


def resolve(roots, wheelhouse: Path, host=None, **kw) -> bc.Closure:
    return bc.resolve(
        roots, target=TARGET, host=host or {}, fetcher=bc.WheelhouseFetcher(wheelhouse, log=lambda s: None), **kw
    )


# --------------------------------------------------------------------------------------------------------------------
# closure


def test_host_satisfied_requirements_are_skipped_and_others_downloaded(tmp_path):
    house = tmp_path / "house"
    make_wheel(house, "dep-a", "1.0")
    make_wheel(house, "dep-a", "2.0")
    make_wheel(house, "dep-b", "1.5")
    root = make_wheel(tmp_path / "dist", "eng", "1.0", ["dep-a>=1", "dep-b", "numpy>=2"])
    c = resolve([root], house, host=bc.parse_freeze("numpy==2.5.2\ndep-b==0.9\n"))
    assert c.picks["numpy"].source == bc.HOST
    assert c.picks["dep-a"].source == bc.DOWNLOADED and c.picks["dep-a"].version == "2.0"  # newest satisfying
    # the host has dep-b 0.9, which satisfies the bare requirement: not bundled
    assert c.picks["dep-b"].source == bc.HOST
    assert [p.name for p in c.bundled()] == ["dep-a", "eng"]
    assert c.picks["dep-a"].reasons[0].by == "eng 1.0"
    assert not c.conflicts


def test_markers_are_evaluated_for_the_target_not_for_this_machine(tmp_path):
    house = tmp_path / "house"
    for n in ("only-312", "only-old", "only-win", "x86-only", "via-extra"):
        make_wheel(house, n, "1.0")
    root = make_wheel(
        tmp_path / "dist",
        "eng",
        "1.0",
        [
            'only-312; python_version >= "3.12"',  # true for the target even when the tests run on 3.11
            'only-old; python_version < "3.12"',
            'only-win; sys_platform == "win32"',
            'x86-only; platform_machine == "x86_64"',
            'via-extra; extra == "bench"',
        ],
    )
    c = resolve([root], house)
    assert set(c.picks) == {"eng", "only-312", "x86-only"}


def test_recursion_and_extras(tmp_path):
    house = tmp_path / "house"
    make_wheel(house, "mid", "1.0", ["leaf>=2", 'extra-dep; extra == "standard"'])
    make_wheel(house, "leaf", "2.1", ["deeper==3"])
    make_wheel(house, "deeper", "3")
    make_wheel(house, "extra-dep", "0.1")
    root = make_wheel(tmp_path / "dist", "eng", "1.0", ["mid[standard]"])
    c = resolve([root], house)
    assert {p.name for p in c.bundled()} == {"eng", "mid", "leaf", "deeper", "extra-dep"}
    assert str(c.picks["deeper"].reasons[0]) == "leaf 2.1: deeper==3"


def test_version_conflict_is_reported(tmp_path):
    house = tmp_path / "house"
    make_wheel(house, "shared", "1.0")
    make_wheel(house, "shared", "2.0")
    make_wheel(house, "late", "1.0", ["shared>=2"])
    root = make_wheel(tmp_path / "dist", "eng", "1.0", ["shared==1.0", "late"])
    c = resolve([root], house)
    assert c.picks["shared"].version == "1.0"
    assert len(c.conflicts) == 1
    assert "shared" in c.conflicts[0] and "late 1.0: shared>=2" in c.conflicts[0]


def test_host_version_that_does_not_satisfy_is_replaced_unless_accepted(tmp_path):
    house = tmp_path / "house"
    make_wheel(house, "numba", "0.65.0")
    root = make_wheel(tmp_path / "dist", "eng", "1.0", ["numba==0.65.0"])
    host = {"numba": "0.68.0"}
    c = resolve([root], house, host=host)
    assert c.picks["numba"].source == bc.DOWNLOADED and "replaces the host's 0.68.0" in c.picks["numba"].note
    c = resolve([root], house, host=host, accept_host={"numba"})
    assert c.picks["numba"].source == bc.HOST_ACCEPTED and not c.conflicts


def test_prefer_overrides_the_host_and_pins_and_exclude_prunes_a_subtree(tmp_path):
    house = tmp_path / "house"
    make_wheel(house, "transformers", "5.12.1", ["tokenizers<=0.23.0,>=0.22"])
    make_wheel(house, "tokenizers", "0.22.2")
    make_wheel(house, "tokenizers", "0.23.0")
    make_wheel(house, "heavy", "1.0", ["heavier"])
    root = make_wheel(tmp_path / "dist", "eng", "1.0", ["transformers>=5", "heavy"])
    pinned = [bc.PinnedWheel("tokenizers", "0.23.0", lambda: house / "tokenizers-0.23.0-py3-none-any.whl")]
    c = resolve(
        [root],
        house,
        host={"transformers": "5.17.0", "tokenizers": "0.23.2"},
        prefer=bc.parse_prefer(["transformers==5.12.1", "tokenizers==0.22.2"]),
        pinned=pinned,
        exclude={"heavy": "not needed here"},
    )
    assert c.picks["transformers"].source == bc.PREFERRED and c.picks["transformers"].version == "5.12.1"
    assert c.picks["tokenizers"].version == "0.22.2"  # --prefer beats the pin
    assert c.picks["heavy"].source == bc.EXCLUDED and "heavier" not in c.picks
    c2 = resolve(
        [root],
        house,
        host={"transformers": "5.17.0", "tokenizers": "0.23.2"},
        pinned=pinned,
        prefer=bc.parse_prefer(["transformers==5.12.1"]),
        exclude={"heavy": ""},
    )
    assert c2.picks["tokenizers"].source == bc.PINNED and c2.picks["tokenizers"].version == "0.23.0"


DILL_WHY = "imported by sglang/srt/sampling/custom_logit_processor.py; declared only through datasets"


def test_parse_require_takes_one_exact_version_and_the_reason_after_it():
    req = bc.parse_require([f"Dill==0.4.1={DILL_WHY}", "msgpack == 1.1.0", "a.b==2.0=why: x=y"])
    assert list(req) == ["dill", "msgpack", "a-b"]
    assert (req["dill"].by, req["dill"].requirement, req["dill"].why) == (bc.REQUIRE, "Dill==0.4.1", DILL_WHY)
    assert req["msgpack"].why == "" and req["a-b"].why == "why: x=y"  # only the first '=' after the version splits
    assert str(req["dill"]) == f"--require: Dill==0.4.1 ({DILL_WHY})"
    for bad in ("dill", "dill>=0.4", "dill==", "==0.4.1", "dill==0.4.*", "dill===0.4.1", "dill==banana"):
        with pytest.raises(ValueError, match="NAME==VERSION"):
            bc.parse_require([bad])
    with pytest.raises(ValueError, match="twice"):
        bc.parse_require(["dill==0.4.1", "dill==0.4.0"])


def _sglang_like(tmp_path: Path) -> tuple[Path, Path]:
    """An engine that imports dill but declares it only through an excluded 'datasets'; dill needs 'multiprocess'."""
    house = tmp_path / "house"
    make_wheel(house, "dill", "0.4.1", ["multiprocess>=0.70"])
    make_wheel(house, "dill", "0.4.2")  # newer: --require must still get exactly 0.4.1
    make_wheel(house, "multiprocess", "0.70.18")
    make_wheel(house, "datasets", "4.0", ["dill<0.4.2,>=0.3"])
    root = make_wheel(tmp_path / "dist", "eng", "1.0", ["datasets"])
    return root, house


def test_require_brings_an_undeclared_package_and_what_it_needs(tmp_path):
    root, house = _sglang_like(tmp_path)
    exclude = {"datasets": "benchmarks only"}
    assert "dill" not in resolve([root], house, exclude=exclude).picks  # the failure --require is for
    c = resolve([root], house, exclude=exclude, require=bc.parse_require([f"dill==0.4.1={DILL_WHY}"]))
    assert (c.picks["dill"].source, c.picks["dill"].version) == (bc.DOWNLOADED, "0.4.1")
    assert [str(r) for r in c.picks["dill"].reasons] == [f"--require: dill==0.4.1 ({DILL_WHY})"]
    assert str(c.picks["multiprocess"].reasons[0]) == "dill 0.4.1: multiprocess>=0.70"  # walked like any wheel
    assert not c.conflicts and not c.warnings
    # the host's matching version is used, not bundled
    c = resolve([root], house, host={"dill": "0.4.1"}, exclude=exclude, require=bc.parse_require(["dill==0.4.1"]))
    assert c.picks["dill"].source == bc.HOST and "multiprocess" not in c.picks


def test_require_that_the_engine_already_declares_is_reported_as_not_needed(tmp_path):
    root, house = _sglang_like(tmp_path)
    c = resolve([root], house, require=bc.parse_require(["dill==0.4.1"]))
    assert c.picks["dill"].version == "0.4.1" and not c.conflicts
    assert c.warnings == [
        "--require dill==0.4.1: datasets 4.0: dill<0.4.2,>=0.3 already asks for it; the option can go"
    ]


def test_require_against_the_host_a_pin_or_a_prefer_is_a_conflict(tmp_path):
    root, house = _sglang_like(tmp_path)
    exclude = {"datasets": ""}
    require = bc.parse_require([f"dill==0.4.1={DILL_WHY}"])
    c = resolve([root], house, host={"dill": "0.3.8"}, exclude=exclude, require=require)
    assert c.conflicts == [f"dill: host version 0.3.8 does not satisfy --require: dill==0.4.1 ({DILL_WHY})"]
    # settled explicitly: use the host's, or --prefer the required version to replace it
    c = resolve([root], house, host={"dill": "0.3.8"}, exclude=exclude, require=require, accept_host={"dill"})
    assert c.picks["dill"].source == bc.HOST_ACCEPTED and not c.conflicts
    c = resolve(
        [root], house, host={"dill": "0.3.8"}, exclude=exclude, require=require, prefer=bc.parse_prefer(["dill==0.4.1"])
    )
    assert (c.picks["dill"].source, c.picks["dill"].version) == (bc.PREFERRED, "0.4.1") and not c.conflicts
    pinned = [bc.PinnedWheel("dill", "0.4.2", lambda: house / "dill-0.4.2-py3-none-any.whl")]
    c = resolve([root], house, exclude=exclude, require=require, pinned=pinned)
    assert c.conflicts == [f"dill: build/pins.toml version 0.4.2 does not satisfy --require: dill==0.4.1 ({DILL_WHY})"]
    c = resolve([root], house, exclude=exclude, require=require, prefer=bc.parse_prefer(["dill==0.4.2"]))
    assert c.conflicts == [f"dill: --prefer version 0.4.2 does not satisfy --require: dill==0.4.1 ({DILL_WHY})"]


def test_wheels_for_other_platforms_or_pythons_are_not_picked(tmp_path):
    house = tmp_path / "house"
    make_wheel(house, "native", "2.0", tag="cp313-cp313-manylinux_2_28_x86_64")
    make_wheel(house, "native", "1.0", tag="cp312-cp312-manylinux_2_17_x86_64")
    make_wheel(house, "native", "3.0", tag="cp312-cp312-manylinux_2_40_x86_64")  # newer glibc than the target
    root = make_wheel(tmp_path / "dist", "eng", "1.0", ["native"])
    assert resolve([root], house).picks["native"].version == "1.0"


def test_parse_freeze():
    text = "# comment\nTorch==2.11.0\nfoo_bar===1.0\nbaz @ file:///x\n-e git+https://x#egg=q\n"
    assert bc.parse_freeze(text) == {"torch": "2.11.0", "foo-bar": "1.0", "baz": ""}


# --------------------------------------------------------------------------------------------------------------------
# parts


def test_split_round_trip(tmp_path):
    data = os.urandom(300_000)
    src = tmp_path / "blob.bin"
    src.write_bytes(data)
    out = tmp_path / "out"
    out.mkdir()
    split, name = ba.write_archive([("root/blob.bin", src)], out, "t", "none", part_size=64 * 1024)
    assert len(split.parts) > 4
    assert all(p.size <= 64 * 1024 for p in split.parts)
    joined = b"".join((out / p.name).read_bytes() for p in split.parts)
    assert hashlib.sha256(joined).hexdigest() == split.whole.hexdigest()
    assert all(hashlib.sha256((out / p.name).read_bytes()).hexdigest() == p.sha256 for p in split.parts)
    (tmp_path / name).write_bytes(joined)
    import tarfile

    with tarfile.open(tmp_path / name) as t:
        assert t.extractfile("root/blob.bin").read() == data


@pytest.mark.parametrize("compression", ["gz", "xz"])
def test_compressed_archive_round_trip(tmp_path, compression):
    src = tmp_path / "text.txt"
    src.write_text("graphpersist " * 20000)
    out = tmp_path / "out"
    out.mkdir()
    split, name = ba.write_archive([("r/text.txt", src)], out, "t", compression, part_size=1000)
    assert name.endswith(ba.COMPRESSIONS[compression]) and all(p.size <= 1000 for p in split.parts)
    joined = tmp_path / name
    joined.write_bytes(b"".join((out / p.name).read_bytes() for p in split.parts))
    import tarfile

    with tarfile.open(joined) as t:
        assert t.extractfile("r/text.txt").read() == src.read_bytes()


def test_parse_size():
    assert ba.parse_size("60MiB") == 60 * 2**20
    assert ba.parse_size("512k") == 512 * 1024
    assert ba.parse_size("1000") == 1000
    with pytest.raises(ValueError):
        ba.parse_size("sixty")


# --------------------------------------------------------------------------------------------------------------------
# the whole command: a small "vllm" bundle, verified, installed by install.sh


@pytest.fixture
def small_bundle(tmp_path):
    """dist/ with a fake vllm engine + graphpersist, a wheelhouse with its one dependency, a host freeze."""
    dist = tmp_path / "dist"
    make_wheel(
        dist,
        "vllm",
        "0.26.0+gp.1",
        ["graphpersist==1", "tinydep>=1", "numpy", 'winonly; sys_platform == "win32"'],
        files={
            "vllm/__init__.py": "import tinydep\n__version__ = '0.26.0'\n",
            "vllm/big_fa2.so": os.urandom(200_000),
            "vllm/third_party/sm100/a.h": "x" * 1000,
        },
    )
    make_wheel(dist, "graphpersist", "1")
    house = tmp_path / "house"
    make_wheel(house, "tinydep", "1.2", files={"tinydep/__init__.py": "VALUE = 42\n"})
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("numpy==2.5.2\ntorch==2.11.0\n")
    out = tmp_path / "bundle"
    argv = [
        "bundle",
        "--dist",
        str(dist),
        "--engine",
        "vllm",
        "--host-freeze",
        str(freeze),
        "--wheelhouse",
        str(house),
        "--out",
        str(out),
        "--part-size",
        "64KiB",
    ]
    return tmp_path, argv, out / "vllm"


def run_cli(argv) -> int:
    return bundle.main(argv)


def test_bundle_writes_parts_manifest_and_verifies(small_bundle, capsys):
    _, argv, bdir = small_bundle
    assert run_cli(argv) == 0
    m = json.loads((bdir / "manifest.json").read_text())
    assert {w["name"] for w in m["wheels"]} == {"vllm", "graphpersist", "tinydep"}
    tiny = next(w for w in m["wheels"] if w["name"] == "tinydep")
    assert tiny["required_by"] == ["vllm 0.26.0+gp.1: tinydep>=1"] and tiny["source"] == "downloaded"
    assert {(p["name"], p["source"]) for p in m["not_bundled"]} == {("numpy", "host")}
    assert len(m["parts"]) >= 2 and all(p["size"] <= 64 * 1024 for p in m["parts"])
    assert ba.verify_bundle(bdir).ok
    assert run_cli(["bundle", "--verify", str(bdir)]) == 0
    # the dist wheel travels byte-identical when nothing is dropped
    dist_whl = next((small_bundle[0] / "dist").glob("vllm-*.whl"))
    assert next(w for w in m["wheels"] if w["name"] == "vllm")["sha256"] == ba.sha256_file(dist_whl)


def test_corrupted_or_missing_part_is_refused_by_the_python_verifier(small_bundle):
    _, argv, bdir = small_bundle
    assert run_cli(argv) == 0
    parts = sorted(bdir.glob("*.part*"))
    raw = bytearray(parts[1].read_bytes())
    raw[100] ^= 0xFF
    parts[1].write_bytes(bytes(raw))
    res = ba.verify_bundle(bdir)
    assert not res.ok and parts[1].name in res.problems[0] and "CORRUPTED" in res.problems[0]
    assert run_cli(["bundle", "--verify", str(bdir)]) == 1
    parts[-1].unlink()
    res = ba.verify_bundle(bdir)
    assert any(parts[-1].name in p and "MISSING" in p for p in res.problems)


def _install_sh(bdir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(bdir / "install.sh"), "--python", sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_install_sh_installs_into_target_and_it_imports(small_bundle, tmp_path):
    _, argv, bdir = small_bundle
    assert run_cli(argv) == 0
    site = tmp_path / "site"
    proc = _install_sh(bdir, "--target", str(site))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok   gpbundle-vllm.tar.gz.part000" in proc.stdout
    assert "tinydep 1.2 (vllm 0.26.0+gp.1 requires tinydep>=1)" in proc.stdout  # it says what it installs
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import vllm, tinydep, graphpersist, importlib.metadata as m; "
            "print(vllm.__version__, tinydep.VALUE, m.version('vllm'))",
        ],
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == ["0.26.0", "42", "0.26.0+gp.1"]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_install_sh_refuses_a_corrupted_part_and_a_missing_part(small_bundle, tmp_path):
    _, argv, bdir = small_bundle
    assert run_cli(argv) == 0
    parts = sorted(bdir.glob("*.part*"))
    raw = bytearray(parts[0].read_bytes())
    raw[-1] ^= 0x01
    parts[0].write_bytes(bytes(raw))
    site = tmp_path / "site"
    proc = _install_sh(bdir, "--target", str(site))
    assert proc.returncode == 1
    assert f"part {parts[0].name} is CORRUPTED" in proc.stderr and "refusing to install" in proc.stderr
    assert not site.exists()
    parts[-1].unlink()
    proc = _install_sh(bdir, "--verify-only")
    assert proc.returncode == 1 and f"part {parts[-1].name} is MISSING" in proc.stderr
    assert _install_sh(bdir, "--bogus").returncode == 2


def test_drop_path_rewrites_the_engine_wheel_with_a_correct_record(small_bundle, tmp_path):
    root, argv, bdir = small_bundle
    argv += ["--drop-path", "vllm/big_fa2.so", "--drop-path", "vllm/third_party/*", "--compression", "xz"]
    assert run_cli(argv) == 0
    m = json.loads((bdir / "manifest.json").read_text())
    eng = next(w for w in m["wheels"] if w["name"] == "vllm")
    dist_whl = next((root / "dist").glob("vllm-*.whl"))
    assert eng["trimmed"]["original_sha256"] == ba.sha256_file(dist_whl) != eng["sha256"]
    assert sorted(eng["trimmed"]["dropped"]) == ["vllm/big_fa2.so", "vllm/third_party/sm100/a.h"]
    site = tmp_path / "site"
    assert _install_sh(bdir, "--target", str(site), "--keep", "--workdir", str(tmp_path / "w")).returncode == 0
    rewritten = next((tmp_path / "w").rglob("vllm-*.whl"))
    assert ba.check_record(rewritten) == []
    assert not (site / "vllm" / "big_fa2.so").exists() and (site / "vllm" / "__init__.py").exists()
    note = next(site.glob("vllm-*.dist-info")) / "GP_BUNDLE_DROPPED"
    assert "vllm/big_fa2.so" in note.read_text()
    assert ba.sha256_file(dist_whl) == eng["trimmed"]["original_sha256"]  # dist/ untouched


def test_conflicts_exit_1_and_misuse_exit_2(small_bundle, tmp_path, capsys):
    root, argv, _ = small_bundle
    assert run_cli([*argv, "--drop-path", "nothing/matches/*"]) == 2
    assert run_cli([*argv, "--part-size", "lots"]) == 2
    assert run_cli([*argv[:2], str(tmp_path / "empty"), *argv[3:]]) == 2  # no dist wheels
    make_wheel(root / "house", "tinydep", "0.5", files={"tinydep/__init__.py": ""})
    assert run_cli([*argv, "--prefer", "tinydep==0.5", "--dry-run"]) == 1
    assert "CONFLICT" in capsys.readouterr().err


def test_require_reaches_manifest_lock_and_install(small_bundle, tmp_path):
    root, argv, bdir = small_bundle
    make_wheel(root / "house", "undeclared", "2.0", files={"undeclared/__init__.py": "OK = 1\n"})
    assert run_cli([*argv, "--require", "undeclared==2.0=imported by vllm/x.py; declared only through a test"]) == 0
    m = json.loads((bdir / "manifest.json").read_text())
    w = next(w for w in m["wheels"] if w["name"] == "undeclared")
    assert w["why"] == "--require undeclared==2.0: imported by vllm/x.py; declared only through a test"
    assert w["required_by"] == ["--require: undeclared==2.0 (imported by vllm/x.py; declared only through a test)"]
    assert w["sha256"] == ba.sha256_file(root / "house" / "undeclared-2.0-py3-none-any.whl")
    assert m["options"]["require"] == ["undeclared==2.0=imported by vllm/x.py; declared only through a test"]
    lock = (bdir / "requirements.lock").read_text().splitlines()
    assert f"undeclared==2.0 --hash=sha256:{w['sha256']}  # downloaded: {w['why']}" in lock
    site = tmp_path / "site"
    assert _install_sh(bdir, "--target", str(site)).returncode == 0
    assert (site / "undeclared" / "__init__.py").read_text() == "OK = 1\n"


def test_require_misuse_exits_2_and_a_host_conflict_exits_1(small_bundle, capsys):
    _, argv, _ = small_bundle
    assert run_cli([*argv, "--require", "tinydep>=1"]) == 2
    assert "NAME==VERSION" in capsys.readouterr().err
    assert run_cli([*argv, "--require", "tinydep==1.2", "--exclude", "tinydep=no"]) == 2
    assert "--require and --exclude both name tinydep" in capsys.readouterr().err
    assert run_cli([*argv, "--require", "numpy==2.4.0=imported by vllm", "--dry-run"]) == 1  # the host has 2.5.2
    err = capsys.readouterr().err
    assert "CONFLICT: numpy: host version 2.5.2 does not satisfy --require: numpy==2.4.0 (imported by vllm)" in err
    assert "--prefer the same version to replace the host's" in err


def test_help_exits_0(capsys):
    with pytest.raises(SystemExit) as exc:
        bundle.main(["bundle", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--drop-path" in out and "--require NAME==VER[=REASON]" in out


def test_engine_all_writes_one_self_contained_bundle_per_engine(small_bundle):
    root, argv, bdir = small_bundle
    make_wheel(root / "dist", "sglang", "0.5.17+gp.1", ["graphpersist==1", "numpy"])
    i = argv.index("--engine")
    assert run_cli([*argv[:i], "--engine", "all", *argv[i + 2 :]]) == 0
    for engine in ("vllm", "sglang"):
        m = json.loads((bdir.parent / engine / "manifest.json").read_text())
        assert m["engine"] == engine and "graphpersist" in {w["name"] for w in m["wheels"]}
        assert ba.verify_bundle(bdir.parent / engine).ok


def test_pip_fetcher_asks_pip_for_the_targets_tags_and_finds_the_saved_wheel(tmp_path):
    """The real fetcher, with a stand-in for `python -m pip` that records its arguments (no network)."""
    made = make_wheel(tmp_path / "made", "pydantic-core", "2.50.5", tag="cp312-cp312-manylinux_2_17_x86_64")
    fake = tmp_path / "fakepython"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$@" > {tmp_path}/args\n'
        "while [[ $# -gt 0 ]]; do [[ $1 == -d ]] && dest=$2; shift; done\n"
        f'cp {made} "$dest/" && echo "Saved $dest/{made.name}"\n'
    )
    fake.chmod(0o755)
    fetch = bc.PipFetcher(tmp_path / "cache", python=str(fake), log=lambda s: None)
    from packaging.specifiers import SpecifierSet

    path = fetch("pydantic-core", SpecifierSet("==2.50.5"), TARGET)
    assert path.name == made.name and path.parent == tmp_path / "cache"
    args = (tmp_path / "args").read_text().split()
    assert args[:6] == ["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check"]
    assert "--python-version" in args and args[args.index("--python-version") + 1] == "3.12"
    plats = [args[i + 1] for i, a in enumerate(args) if a == "--platform"]
    assert plats[0] == "manylinux_2_39_x86_64" and "manylinux_2_28_x86_64" in plats and plats[-1] == "manylinux1_x86_64"
    assert args[-1] == "pydantic-core==2.50.5"


def test_options_file_with_comments_and_quoted_reasons(small_bundle, tmp_path):
    """The recipe passes its options as @recipes/gpu-host/vllm.args: one option per line, # comments, quotes."""
    _, argv, bdir = small_bundle
    opts = tmp_path / "opts.args"
    opts.write_text('# a comment\n--exclude "tinydep=not needed: see README"   # trailing comment\n--dry-run\n')
    assert run_cli([*argv, f"@{opts}"]) == 0
    assert not (bdir / "manifest.json").exists()  # --dry-run came from the file
    assert run_cli([*argv, f"@{opts}", "--json"]) == 0


def test_recipe_options_files_parse():
    here = Path(__file__).resolve().parents[2] / "recipes" / "gpu-host"
    parser = bundle._ArgFileParser(fromfile_prefix_chars="@")
    bundle.add_arguments(parser)
    for name in ("vllm.args", "sglang.args"):
        args = parser.parse_args([f"@{here / name}"])
        assert args.engine == name.split(".")[0] and args.compression == "xz" and args.exclude
        assert not set(bc.parse_require(args.require)) & {n.partition("=")[0] for n in args.exclude}
        if name == "sglang.args":  # sglang imports dill at start-up; only the excluded datasets declares it
            assert bc.parse_require(args.require)["dill"].requirement == "dill==0.4.1"
            # the HTTP server imports jsonschema (declared only through excluded packages) and soundfile
            assert "jsonschema" in bc.parse_require(args.require)
            assert "soundfile" not in {n.partition("=")[0] for n in args.exclude}


def test_with_library_brings_our_dist_wheel_for_the_targets_python_never_an_index(small_bundle, capsys):
    """deep_ep: SGLang imports it without declaring it; dist/ holds one wheel per CPython (3.10-3.13). The bundle
    takes the one for the target (CPython 3.12 here), at its exact version, from dist/ (the wheelhouse has none)."""
    root, argv, bdir = small_bundle
    version = "1.2.1.post20251110+gp.1"
    for py in ("cp310", "cp311", "cp312", "cp313"):
        make_wheel(root / "dist", "deep_ep", version, ["graphpersist==1", "numpy"],
                   tag=f"{py}-{py}-manylinux_2_28_x86_64")  # fmt: skip
    why = "imported by sglang/srt/layers/moe/token_dispatcher/deepep.py"
    assert run_cli([*argv, "--with-library", f"deep_ep={why}"]) == 0
    m = json.loads((bdir / "manifest.json").read_text())
    [ep] = [w for w in m["wheels"] if w["name"] == "deep-ep"]
    assert (ep["file"], ep["version"], ep["source"]) == (
        f"deep_ep-{version}-cp312-cp312-manylinux_2_28_x86_64.whl", version, "dist")  # fmt: skip
    assert ep["sha256"] == ba.sha256_file(root / "dist" / ep["file"])
    assert ep["required_by"] == [f"--require: deep_ep=={version} ({why})"]
    assert m["options"]["with_library"] == [f"deep_ep={why}"]
    assert run_cli([*argv, "--with-library", "nosuchlib"]) == 2
    assert "--with-library nosuchlib: 0 wheels of nosuchlib" in capsys.readouterr().err


def test_the_sglang_bundle_plan_carries_our_deep_ep_and_deepgemm():
    """recipes/gpu-host/sglang.args: our deep_ep wheel (SGLang's --moe-a2a-backend deepep imports it) and DeepGEMM
    (DeepEP's normal mode runs BF16 experts on it) are brought, not excluded."""
    here = Path(__file__).resolve().parents[2] / "recipes" / "gpu-host"
    parser = bundle._ArgFileParser(fromfile_prefix_chars="@")
    bundle.add_arguments(parser)
    args = parser.parse_args([f"@{here / 'sglang.args'}"])
    assert [v.partition("=")[0] for v in args.with_library] == ["deep_ep"]
    assert not {"deep-ep", "deep_ep", "sgl-deep-gemm"} & {n.partition("=")[0] for n in args.exclude}
