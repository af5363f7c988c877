"""The JIT caches an archive carries (graphpersist.archive.jitcache), the shared archive file that holds them, and the
vLLM worker's cache folders (overlays/vllm/vllm/graphpersist_caches.py, loaded without vLLM).

What LOAD on a fresh host relies on: a collect is deterministic and carries every regular file with its executable
bit and its exact modification time (ninja compares them); a restore writes only what the live folders lack, in
several processes at once, and hostile content never writes anything, let alone outside the named folders.
"""

from __future__ import annotations

import errno
import importlib.machinery
import importlib.util
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import time
import types
from pathlib import Path
from typing import Any

import hostile_tars
import pytest
from archive_fixtures import world, write_archive, write_rank
from module_file import load_module

from graphpersist import cachefolders, switch
from graphpersist.archive import ArchiveError, ArchiveWriter, jitcache, open_archive, read_shared
from graphpersist.archive.jitcache import collect, restore
from graphpersist.engine import EngineAdapter, PersistSession
from graphpersist.errors import JitCacheError, PersistError

REPO = Path(__file__).resolve().parents[2]
MTIME_NS = 1_700_000_000_123_456_789  # nanoseconds that a float would round


def make_cache(root: Path) -> dict[str, Path]:
    """Two cache folders as compilers leave them: nested files, a JIT .so, locks, temporaries, a link, a FIFO."""
    triton, flashinfer = root / "triton", root / "flashinfer"
    files = {
        triton / "AB12" / "kernel.cubin": b"\x7fELF cubin",
        triton / "AB12" / "kernel.json": b'{"num_warps": 4}',
        triton / "__grp__x.json": b"{}",
        flashinfer / "0.6.14" / "90a" / "cached_ops" / "sampling" / "sampling.so": b"\x7fELF so",
        flashinfer / "0.6.14" / "90a" / "cached_ops" / "sampling" / ".ninja_log": b"# ninja log v6\n",
        flashinfer / "0.6.14" / "90a" / "cached_ops" / "sampling" / "build.ninja": b"rule cxx\n",
    }
    left_out = {
        flashinfer / "0.6.14" / "90a" / "cached_ops" / "tmp" / "sampling.lock": b"",  # FileLock
        triton / ".lock": b"",
        triton / "AB12" / ".kernel.json.1234.tmp": b"half",  # Inductor's write_atomic
        triton / "tmp.pid_99_abcd" / "kernel.cubin": b"half",  # Triton's staging folder
    }
    for path, data in {**files, **left_out}.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        os.utime(path, ns=(MTIME_NS, MTIME_NS))
    (flashinfer / "0.6.14" / "90a" / "cached_ops" / "sampling" / "sampling.so").chmod(0o755)
    (triton / "link.json").symlink_to(triton / "__grp__x.json")
    (triton / "linked-folder").symlink_to(flashinfer)
    os.mkfifo(triton / "fifo")
    return {"triton": triton, "flashinfer": flashinfer, "deep_gemm": root / "not-there"}


def tree(root: Path) -> dict[str, tuple[bytes, int, int]]:
    """Every regular file below root: relative path -> (bytes, permission bits, mtime in ns)."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            info = path.stat()
            out[path.relative_to(root).as_posix()] = (path.read_bytes(), info.st_mode & 0o777, info.st_mtime_ns)
    return out


def tar_of(*members: tuple[tarfile.TarInfo, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return out.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, **fields: Any) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    for key, value in fields.items():
        setattr(info, key, value)
    return info


# ----------------------------------------------------------------------------------------------------- collect


def test_two_collects_of_one_tree_give_identical_bytes(tmp_path: Path) -> None:
    dirs = make_cache(tmp_path / "cache")
    first, _ = collect(dirs)
    os.utime(dirs["triton"] / "AB12", ns=(1, 1))  # folder times and access times are not content
    (dirs["triton"] / "AB12" / "kernel.json").read_bytes()
    second, _ = collect(dict(reversed(dirs.items())))  # the mapping's order does not matter either
    assert first == second
    os.utime(dirs["triton"] / "AB12" / "kernel.json", ns=(MTIME_NS, MTIME_NS + 1))
    assert collect(dirs)[0] != first  # a file's time is content (ninja compares it)


def test_collect_carries_regular_files_sorted_and_leaves_out_locks_temporaries_and_links(tmp_path: Path) -> None:
    blob, stats = collect(make_cache(tmp_path / "cache"))
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names == [
        "flashinfer/0.6.14/90a/cached_ops/sampling/.ninja_log",
        "flashinfer/0.6.14/90a/cached_ops/sampling/build.ninja",
        "flashinfer/0.6.14/90a/cached_ops/sampling/sampling.so",
        "triton/AB12/kernel.cubin",
        "triton/AB12/kernel.json",
        "triton/__grp__x.json",
    ]
    modes = {m.name.rsplit("/", 1)[1]: m.mode for m in members}
    assert modes["sampling.so"] == 0o755 and modes["kernel.json"] == 0o644  # the executable bit, nothing else
    assert {(m.uid, m.gid, m.uname, m.gname) for m in members} == {(0, 0, "", "")}
    assert {m.pax_headers["mtime"] for m in members} == {"1700000000.123456789"}
    assert stats.files == {"flashinfer": 3, "triton": 3} and stats.absent == ["deep_gemm"]
    assert stats.skipped == {"lock": 2, "temporary": 2, "symlink": 2, "special": 1}
    line = stats.describe()
    assert "flashinfer 3 files" in line and "absent: deep_gemm" in line and "2 symlink" in line, line


def test_listing_names_what_a_collect_carries_without_reading_it(tmp_path: Path) -> None:
    dirs = make_cache(tmp_path / "cache")
    blob, _ = collect(dirs)
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        assert jitcache.listing(dirs) == set(tar.getnames())


def test_collect_refuses_more_than_the_limit_naming_the_biggest_folders(tmp_path: Path) -> None:
    dirs = make_cache(tmp_path / "cache")
    (dirs["triton"] / "HUGE").mkdir()
    (dirs["triton"] / "HUGE" / "kernel.cubin").write_bytes(bytes(3000))
    with pytest.raises(JitCacheError) as caught:
        collect(dirs, limit_bytes=2048)
    message = str(caught.value)
    assert "more than the 2.0 KiB an archive carries" in message, message
    assert f"triton 3.0 KiB ({dirs['triton']})" in message, message  # the named folders, biggest first
    assert f"biggest folders: {dirs['triton'] / 'HUGE'} 2.9 KiB" in message, message
    assert "empty them" in message and "SAVE again" in message


def test_collect_refuses_a_name_that_is_not_one_plain_component(tmp_path: Path) -> None:
    for bad in ("a/b", "..", "", ".hidden"):
        with pytest.raises(ValueError, match="one plain path component"):
            collect({bad: tmp_path})


# ----------------------------------------------------------------------------------------------------- restore


def test_round_trip_restores_bytes_modes_and_exact_times(tmp_path: Path) -> None:
    dirs = make_cache(tmp_path / "cache")
    blob, _ = collect(dirs)
    live = {"triton": tmp_path / "live" / "t", "flashinfer": tmp_path / "live" / "f", "deep_gemm": tmp_path / "dg"}
    stats = restore(blob, live)
    assert stats.files == {"flashinfer": 3, "triton": 3} and stats.kept == {}
    for name in ("triton", "flashinfer"):
        saved = {rel: v for rel, v in tree(dirs[name]).items() if rel in tree(live[name])}
        assert tree(live[name]) == saved and len(saved) == 3
    assert tree(live["flashinfer"])["0.6.14/90a/cached_ops/sampling/sampling.so"][1:] == (0o755, MTIME_NS)
    assert not live["deep_gemm"].exists()  # nothing of it was carried
    assert collect(live)[0] == blob  # the restored tree collects to the same bytes


def test_restore_never_overwrites_what_the_host_has(tmp_path: Path) -> None:
    blob, _ = collect(make_cache(tmp_path / "cache"))
    live = {"triton": tmp_path / "live"}
    own = live["triton"] / "AB12" / "kernel.json"
    own.parent.mkdir(parents=True)
    own.write_bytes(b"this host's own")
    (live["triton"] / "__grp__x.json").symlink_to(tmp_path / "elsewhere")  # a link is kept, never written through
    stats = restore(blob, live)
    assert own.read_bytes() == b"this host's own"
    assert not (tmp_path / "elsewhere").exists()
    assert stats.files == {"triton": 1} and stats.kept == {"triton": 2}
    assert stats.skipped == {"unconfigured": 3}  # flashinfer is not configured here: skipped, counted
    again = restore(blob, live)
    assert again.files == {} and again.kept == {"triton": 3}
    assert "triton 0 files 0 B (3 kept)" in again.describe()


CONCURRENT = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, {overlay!r})
from graphpersist.archive import jitcache
blob = Path({blob!r}).read_bytes()
while not Path({go!r}).exists():
    time.sleep(0.001)
stats = jitcache.restore(blob, {{"triton": Path({live!r})}})
print(json.dumps({{"written": stats.files.get("triton", 0), "kept": stats.kept.get("triton", 0)}}))
"""


def test_two_processes_restore_into_one_folder_at_once(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for i in range(400):
        path = src / f"{i % 40:02d}" / f"k{i:03d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(2000 + i))
    blob, _ = collect({"triton": src})
    (tmp_path / "blob.tar").write_bytes(blob)
    live, go = tmp_path / "live", tmp_path / "go"
    code = CONCURRENT.format(overlay=str(REPO / "overlays" / "graphpersist"), blob=str(tmp_path / "blob.tar"),
                             go=str(go), live=str(live))  # fmt: skip
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    time.sleep(0.3)  # both are waiting for the start
    go.touch()
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        results.append(json.loads(out))
    assert all(r["written"] + r["kept"] == 400 for r in results), results
    assert sum(r["written"] for r in results) >= 400  # every file written once (twice where both found it absent)
    assert tree(live) == tree(src)  # whole files only, no leftovers
    assert not [p for p in live.rglob("*") if ".tmp" in p.name]


def snapshot(root: Path) -> dict[str, tuple[str, bytes, int]]:
    """Every entry below root (links not followed): relative path -> (kind, bytes of a file, its mtime in ns)."""
    out = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        kind = {stat.S_IFREG: "file", stat.S_IFDIR: "folder", stat.S_IFLNK: "link"}.get(
            stat.S_IFMT(info.st_mode), "other"
        )
        data = path.read_bytes() if kind == "file" else b""
        out[path.relative_to(root).as_posix()] = (kind, data, info.st_mtime_ns if kind == "file" else 0)
    return out


def live_folders(box: Path) -> dict[str, Path]:
    """A host's cache folders: triton holds a file of its own, flashinfer does not exist yet."""
    (box / "triton").mkdir(parents=True)
    (box / "triton" / "own.bin").write_bytes(b"this host's own")
    return {"triton": box / "triton", "flashinfer": box / "fresh" / "flashinfer"}


@pytest.mark.parametrize("label", sorted(hostile_tars.HOSTILE))
def test_hostile_tars_are_refused_and_leave_the_cache_folders_as_they_were(tmp_path: Path, label: str) -> None:
    """Each hostile header (pax mtime nan/inf/25 digits, a malformed GNU sparse member, links, devices, '..',
    absolute paths, garbage, truncated, gzip, ...) is a JitCacheError before anything is written, even the good
    member before it."""
    blob, problem = hostile_tars.HOSTILE[label]
    dirs = live_folders(tmp_path / "box")
    before = snapshot(tmp_path)
    with pytest.raises(JitCacheError, match=re.escape(problem)) as caught:
        restore(blob, dirs)
    assert "nothing was restored" in str(caught.value)
    assert snapshot(tmp_path) == before
    assert not any(c in str(caught.value) for c in "\0\n\x1b")


def test_a_header_whose_checksum_sums_signed_bytes_is_read_as_well(tmp_path: Path) -> None:
    """Some tar writers sum a header's bytes as signed: a name with bytes of 0x80 and more then carries a checksum
    256 less per such byte. Both sums are accepted; any other checksum is refused (the hostile catalogue)."""
    name = "triton/caf\u00e9.json".encode()
    block = bytearray(hostile_tars.header(name, size=2))
    unsigned = int(block[148:154], 8)
    signed = unsigned - 256 * sum(1 for b in block[:148] + block[156:] if b & 0x80)
    assert signed != unsigned
    block[148:156] = b"%06o\0 " % signed
    stats = restore(hostile_tars.tar(bytes(block) + hostile_tars.padded(b"{}")), {"triton": tmp_path / "t"})
    assert stats.files == {"triton": 1}
    assert (tmp_path / "t" / "caf\u00e9.json").read_bytes() == b"{}"


def test_folders_in_the_tar_are_made_below_the_cache_folder(tmp_path: Path) -> None:
    blob = tar_of((member("triton/dir", tarfile.DIRTYPE), b""), (member("triton/empty", tarfile.DIRTYPE), b""),
                  (member("triton/dir/sub/f.json"), b"{}"))  # fmt: skip
    stats = restore(blob, {"triton": tmp_path / "t"})
    assert stats.files == {"triton": 1}
    assert snapshot(tmp_path / "t") == {
        "dir": ("folder", b"", 0),
        "dir/sub": ("folder", b"", 0),
        "dir/sub/f.json": ("file", b"{}", 0),
        "empty": ("folder", b"", 0),
    }


def test_a_read_only_cache_folder_that_has_every_file_is_kept_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A warm host whose cache is mounted read-only: nothing to write, so nothing is staged and nothing fails."""
    dirs = make_cache(tmp_path / "cache")
    blob, _ = collect(dirs)
    before = snapshot(tmp_path)

    def read_only(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(os, "mkdir", read_only)  # root may write anywhere: the file system says no instead
    stats = restore(blob, {"triton": dirs["triton"], "flashinfer": dirs["flashinfer"]})
    monkeypatch.undo()
    assert stats.files == {} and stats.kept == {"triton": 3, "flashinfer": 3}
    assert snapshot(tmp_path) == before


def test_a_folder_that_cannot_be_written_undoes_the_whole_restore(tmp_path: Path) -> None:
    """Files already renamed into place (in another cache folder too) are taken back, and folders the restore made
    are removed: a failed restore leaves the cache folders as they were."""
    dirs = live_folders(tmp_path / "box")
    (dirs["triton"] / "zz").symlink_to(tmp_path / "outside")  # a link below the cache folder: never followed
    blob = tar_of((member("flashinfer/0.6/mod.so", mode=0o755), b"so"), (member("triton/AB12/k.cubin"), b"cubin"),
                  (member("triton/zz/k.json"), b"{}"))  # fmt: skip
    before = snapshot(tmp_path)
    with pytest.raises(JitCacheError, match=r"cannot restore the JIT cache file .*zz/k\.json: .*nothing was restored"):
        restore(blob, dirs)
    assert snapshot(tmp_path) == before
    assert not (tmp_path / "outside").exists() and not (tmp_path / "box" / "fresh").exists()


def test_pax_times_keep_their_nanoseconds_and_sign(tmp_path: Path) -> None:
    blob = hostile_tars.tar(
        hostile_tars.pax({"mtime": "1700000000.5"}), hostile_tars.file("triton/half"),
        hostile_tars.pax({"mtime": "-1.25"}), hostile_tars.file("triton/before-1970"),
        hostile_tars.file("triton/header-time", mtime=1234),
    )  # fmt: skip
    restore(blob, {"triton": tmp_path / "t"})
    times = {name: (tmp_path / "t" / name).stat().st_mtime_ns for name in ("half", "before-1970", "header-time")}
    assert times == {"half": 1_700_000_000_500_000_000, "before-1970": -1_250_000_000, "header-time": 1234 * 10**9}


def test_names_that_are_long_or_not_utf8_round_trip(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    odd = os.fsencode(src) + b"/\xff\xfe-k\xc3\xa9.bin"  # a name that is not UTF-8 (pax hdrcharset BINARY)
    Path(os.fsdecode(odd)).write_bytes(b"odd")
    (src / ("long-" * 40)).write_bytes(b"long")  # past the header's 100 bytes: a pax path
    blob, _ = collect({"triton": src})
    assert restore(blob, {"triton": tmp_path / "t"}).files == {"triton": 2}
    assert tree(tmp_path / "t") == tree(src)


def test_restored_files_get_plain_modes_whatever_the_blob_says(tmp_path: Path) -> None:
    blob = tar_of((member("triton/suid", mode=0o6777), b"x"), (member("triton/open", mode=0o666), b"y"))
    restore(blob, {"triton": tmp_path / "t"})
    assert (tmp_path / "t" / "suid").stat().st_mode & 0o7777 == 0o755 & ~_umask()
    assert (tmp_path / "t" / "open").stat().st_mode & 0o7777 == 0o644 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_restore_does_not_follow_a_link_below_the_cache_folder(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    live = tmp_path / "triton"
    live.mkdir()
    (live / "AB12").symlink_to(outside)
    with pytest.raises(JitCacheError, match=r"cannot restore the JIT cache file .*AB12/kernel\.json"):
        restore(tar_of((member("triton/AB12/kernel.json"), b"{}")), {"triton": live})
    assert list(outside.iterdir()) == []
    linked_root = tmp_path / "linked"
    linked_root.symlink_to(live)  # the cache folder itself may be a link (say ~/.cache on another disk)
    assert restore(tar_of((member("triton/x/y.json"), b"{}")), {"triton": linked_root}).files == {"triton": 1}


# --------------------------------------------------------------------------------------- the archive's shared file


def shared_archive(root: Path, files: dict[str, bytes], world_size: int = 1) -> Path:
    """An archive whose owner writes `files` at the top (as Saver.save does for rank 0)."""
    facts = world(**{"parallel.world_size": world_size})
    with ArchiveWriter(root, facts) as owner:
        assert owner.add_shared(files) == sorted(files)
        write_rank(owner, 0)
        for rank in range(1, world_size):
            other = ArchiveWriter(root, facts, staging=owner.staging)
            with pytest.raises(ArchiveError, match=r"shared files are written by the owner \(rank 0\) only"):
                other.add_shared(files)
            write_rank(other, rank)
        return owner.commit()


def test_shared_file_reads_back_verified_without_hashing_the_rest(tmp_path: Path) -> None:
    root = shared_archive(tmp_path / "a", {jitcache.SHARED_NAME: b"tar bytes"}, world_size=2)
    assert read_shared(root, jitcache.SHARED_NAME) == b"tar bytes"
    assert open_archive(root).read(None, jitcache.SHARED_NAME) == b"tar bytes"
    assert read_shared(write_archive(tmp_path / "old"), jitcache.SHARED_NAME) is None  # an archive without caches
    payload = root / "rank_1" / "allocations.log"
    payload.write_bytes(bytes(len(payload.read_bytes())))  # another file corrupted: not read_shared's business
    assert read_shared(root, jitcache.SHARED_NAME) == b"tar bytes"
    with pytest.raises(ValueError, match="reserved"):
        read_shared(root, "manifest.json")


def test_a_corrupted_shared_file_is_refused_when_read(tmp_path: Path) -> None:
    root = shared_archive(tmp_path / "a", {jitcache.SHARED_NAME: b"tar bytes"})
    (root / jitcache.SHARED_NAME).write_bytes(b"tar bytez")
    with pytest.raises(ArchiveError, match=r"corrupted file jitcache\.tar"):
        read_shared(root, jitcache.SHARED_NAME)
    with pytest.raises(ArchiveError, match=r"corrupted file jitcache\.tar"):
        open_archive(root)  # inspect and check hash every file
    archive = open_archive(root, keep_rank=0)  # a rank's LOAD hashes its own files; shared ones when read
    with pytest.raises(ArchiveError, match=r"corrupted file jitcache\.tar"):
        archive.read(None, jitcache.SHARED_NAME)
    (root / jitcache.SHARED_NAME).write_bytes(b"tar")
    with pytest.raises(ArchiveError, match=r"truncated file jitcache\.tar"):
        read_shared(root, jitcache.SHARED_NAME)
    with pytest.raises(ArchiveError, match=r"no manifest\.json"):
        read_shared(tmp_path, jitcache.SHARED_NAME)
    (root / jitcache.SHARED_NAME).unlink()
    (root / jitcache.SHARED_NAME).symlink_to(tmp_path / "a" / "rank_0" / "rank.json")
    with pytest.raises(ArchiveError, match=r"jitcache\.tar is not a regular file"):
        read_shared(root, jitcache.SHARED_NAME)


# ------------------------------------------------------------------------------- vLLM's cache folders (no vLLM)


def fake_module(monkeypatch: pytest.MonkeyPatch, name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return module


@pytest.fixture
def vllm_caches(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> types.ModuleType:
    """overlays/vllm/vllm/graphpersist_caches.py with stand-ins for vllm.envs, triton.knobs and flashinfer."""
    envs = fake_module(monkeypatch, "vllm.envs", VLLM_CACHE_ROOT=str(tmp_path / "vllm-root"))
    fake_module(monkeypatch, "vllm", envs=envs)

    class Cache:  # triton.knobs.cache.dir reads the variable when asked, as Triton 3.6 does
        @property
        def dir(self) -> str:
            return os.environ.get("TRITON_CACHE_DIR") or str(tmp_path / "home" / ".triton" / "cache")

    knobs = fake_module(monkeypatch, "triton.knobs", cache=Cache())
    fake_module(monkeypatch, "triton", knobs=knobs)
    fake_module(monkeypatch, "flashinfer")
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE", "FLASHINFER_CUBIN_DIR",
                "VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR", "DG_JIT_CACHE_DIR"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = REPO / "overlays" / "vllm" / "vllm" / "graphpersist_caches.py"
    return load_module(path, "graphpersist_caches_under_test")


def test_vllm_cache_folders_follow_the_variables(vllm_caches: types.ModuleType, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path / "fi-base"))
    monkeypatch.setenv("FLASHINFER_CUBIN_DIR", str(tmp_path / "cubins"))
    monkeypatch.setenv("DG_JIT_CACHE_DIR", "~/dg")
    found, left_out = cachefolders.resolve_all(vllm_caches.resolvers())
    assert left_out == {}
    assert found == {
        "vllm_compile": tmp_path / "vllm-root" / "torch_compile_cache",
        "vllm_modelinfos": tmp_path / "vllm-root" / "modelinfos",
        "vllm_flashinfer_autotune": tmp_path / "vllm-root" / "flashinfer_autotune_cache",
        "deep_gemm": tmp_path / "home" / "dg",  # vLLM expands ~ in this one
        "inductor": tmp_path / "inductor",
        "triton": tmp_path / "triton",
        "flashinfer": tmp_path / "fi-base" / ".cache" / "flashinfer",
        "flashinfer_cubins": tmp_path / "cubins",
    }


def test_vllm_cache_folders_default_like_the_libraries(vllm_caches: types.ModuleType, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setitem(sys.modules, "torch", None)  # torch absent: Inductor's default cannot be determined
    found, left_out = cachefolders.resolve_all(vllm_caches.resolvers())
    assert found["triton"] == tmp_path / "home" / ".triton" / "cache"
    assert found["flashinfer"] == tmp_path / "home" / ".cache" / "flashinfer"
    assert found["deep_gemm"] == tmp_path / "vllm-root" / "deep_gemm"
    assert "inductor" not in found and left_out["inductor"].startswith("ModuleNotFoundError")
    assert left_out["flashinfer_cubins"] == "not used here"
    monkeypatch.delitem(sys.modules, "flashinfer")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flashinfer" else object())
    assert "flashinfer" not in cachefolders.resolve_all(vllm_caches.resolvers())[0]  # not installed: not carried


class CachesOnly(EngineAdapter):
    """An engine that answers only the session's cache questions (with vLLM's folders)."""

    def __init__(self, resolvers: dict[str, Any]) -> None:
        self.resolvers = resolvers

    def cache_resolvers(self) -> dict[str, Any]:
        return self.resolvers

    def _unasked(self, *args: Any) -> Any:
        raise AssertionError("the session asked more than its caches")

    engine_facts = model_facts = parallel = config_flags = flags = rank = device_index = _unasked
    cpu_gather = setup_tensors = inventory = install = _unasked


def session(vllm_caches: types.ModuleType, mode: switch.Mode, directory: Path, rank: int = 0) -> PersistSession:
    """A persistence session over vLLM's cache folders, logging into `lines`, as a worker's would be."""
    sess = PersistSession(CachesOnly(vllm_caches.resolvers()), mode, directory, rank, 2)
    lines: list[str] = []
    sess.log = lambda message, *args: lines.append(message % args)  # type: ignore[method-assign]
    sess.lines = lines  # type: ignore[attr-defined]
    return sess


def test_vllm_save_carries_and_load_restores_the_caches(vllm_caches: types.ModuleType, tmp_path: Path) -> None:
    saving = session(vllm_caches, switch.Mode.SAVE, tmp_path / "archive")
    saving.caches.folders = make_cache(tmp_path / "warm")
    root = shared_archive(saving.directory, saving.caches.carry(saving))  # what the session hands the Saver
    assert any(line.startswith("carrying JIT caches") and "triton 3 files" in line for line in saving.lines)
    saving.caches.report_late(saving)
    assert not any("after the archive was written" in line for line in saving.lines)
    late = saving.caches.folders["flashinfer"] / "0.6.14" / "90a" / "cached_ops" / "norm" / "norm.so"
    late.parent.mkdir(parents=True)
    late.write_bytes(b"built by the warm-up after the capture")
    saving.caches.report_late(saving)
    assert saving.lines[-1].startswith("1 JIT cache file(s) were compiled after the archive was written"), saving.lines
    assert "flashinfer/0.6.14/90a/cached_ops/norm/norm.so" in saving.lines[-1]
    rank1 = session(vllm_caches, switch.Mode.SAVE, tmp_path / "rank1", rank=1)
    rank1.caches.report_late(rank1)  # carried nothing: no report
    assert rank1.lines == []

    loading = session(vllm_caches, switch.Mode.LOAD, root)
    loading.caches.folders = {"triton": tmp_path / "fresh" / "triton", "flashinfer": tmp_path / "fresh" / "fi"}
    loading.caches.restore(loading)
    assert "jitcache" in loading.timings
    assert (tmp_path / "fresh" / "fi" / "0.6.14" / "90a" / "cached_ops" / "sampling" / "sampling.so").exists()
    assert "JIT caches restored" in loading.lines[-1] and "triton 3 files" in loading.lines[-1]

    old = session(vllm_caches, switch.Mode.LOAD, write_archive(tmp_path / "old"))
    old.caches.restore(old)
    assert "carries no JIT caches" in old.lines[-1] and "jitcache" not in old.timings

    (root / jitcache.SHARED_NAME).write_bytes(bytes(len((root / jitcache.SHARED_NAME).read_bytes())))
    with pytest.raises(PersistError, match=r"cannot LOAD .*corrupted file jitcache\.tar"):
        broken = session(vllm_caches, switch.Mode.LOAD, root)
        broken.caches.restore(broken)


def test_vllm_load_restores_the_model_inspection_before_the_engine_and_the_rest_in_the_workers(
    vllm_caches: types.ModuleType, tmp_path: Path
) -> None:
    """vLLM reads `modelinfos` while it builds the configuration, before any worker exists: the switch restores
    that folder alone (in the process that builds the engine), the workers everything else."""
    root = tmp_path / "vllm-root"
    saved = {"vllm_modelinfos": root / "modelinfos", "triton": tmp_path / "triton"}
    (saved["vllm_modelinfos"]).mkdir(parents=True)
    (saved["vllm_modelinfos"] / "vllm-model_executor-models-qwen3-Qwen3ForCausalLM.json").write_text("{}")
    (saved["triton"] / "k").mkdir(parents=True)
    (saved["triton"] / "k" / "kernel.cubin").write_bytes(b"cubin")
    blob, _ = jitcache.collect(saved)
    archive = shared_archive(tmp_path / "archive", {jitcache.SHARED_NAME: blob})
    shutil.rmtree(root)
    shutil.rmtree(saved["triton"])

    written = vllm_caches.restore_before_engine(archive)
    assert written == [str(root / "modelinfos" / "vllm-model_executor-models-qwen3-Qwen3ForCausalLM.json")]
    assert not saved["triton"].exists()  # the workers' business, in their own processes
    old = write_archive(tmp_path / "old")  # saved before archives carried the caches
    assert vllm_caches.restore_before_engine(old) == []
    assert vllm_caches.restore_before_engine(tmp_path / "nowhere") == []  # the workers refuse it, naming why


def test_a_hostile_tar_refuses_both_of_loads_restores_writing_nothing(
    vllm_caches: types.ModuleType, tmp_path: Path
) -> None:
    """The early restore (vLLM's configuration process) and the session's (each worker) raise the JitCacheError, a
    PersistError, in the process that runs them; neither writes a file."""
    blob, problem = hostile_tars.HOSTILE["pax mtime nan"]
    root = shared_archive(tmp_path / "archive", {jitcache.SHARED_NAME: blob})
    with pytest.raises(JitCacheError, match=re.escape(problem)):
        vllm_caches.restore_before_engine(root)
    loading = session(vllm_caches, switch.Mode.LOAD, root)
    loading.caches.folders = {"triton": tmp_path / "fresh" / "triton"}
    with pytest.raises(PersistError, match="nothing was restored"):
        loading.caches.restore(loading)
    assert not (tmp_path / "vllm-root").exists() and not (tmp_path / "fresh").exists()
