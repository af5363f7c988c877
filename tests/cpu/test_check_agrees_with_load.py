"""`graphpersist check` refuses whatever LOAD would refuse on CPU, and a newcomer's first archive (issue 41).

Each test pins one behaviour with a case that failed before it (main at b5db8b4), as the item numbers say:

 3  test_comparing_tens_of_thousands_of_facts_is_linear, test_a_manifest_padded_with_100k_flags_is_refused_fast,
    test_each_cap_on_the_world_facts_is_named, test_save_refuses_world_facts_past_a_cap,
    test_a_manifest_edited_without_rehashing_is_refused
 4  test_check_refuses_the_jit_caches_load_refuses, test_check_refuses_the_allocation_logs_load_refuses,
    test_check_refuses_the_phases_load_refuses, test_check_refuses_the_values_load_cannot_use,
    test_check_runs_loads_cpu_stage_for_every_rank, test_live_ranges_of_a_padded_log_are_linear_and_unchanged
 5  test_stripped_digests_do_not_let_a_changed_parameter_byte_through
 8  test_the_demo_archive_is_checked_as_load_reads_it, test_inspect_of_a_missing_rank_names_the_ranks,
    test_a_mistyped_option_prints_the_subcommands_usage_and_the_closest_option,
    test_the_readme_shows_that_diff_takes_two_archives, test_check_says_env_pins_are_read_from_its_own_shell,
    test_make_help_does_not_promise_test_fast_in_under_a_minute

"LOAD's CPU stage" is what a rank's LOAD does before its first GPU call: open_archive(keep_rank=r), use_layout's read
and loadstage.rank_stage (load() calls it), and the JIT caches' restore (jitcache.restore) the engine runs first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import hashlib
import io
import json
import random
import re
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from archive_fixtures import REGION_BASE, REGION_SIZE, forge, live_for, smi_rows, world, write_loadable_archive

from graphpersist import cli, loadstage
from graphpersist.archive import (
    Archive,
    ArchiveError,
    ArchiveWriter,
    codec,
    jitcache,
    liveenv,
    open_archive,
    read_shared,
)
from graphpersist.archive.manifest import MAX_ENV, MAX_FIELD_BYTES, MAX_FIELD_NAME, MAX_FLAGS, ManifestError, World
from graphpersist.archive.validate import evaluate
from graphpersist.errors import JitCacheError
from graphpersist.memory import layout
from graphpersist.memory.region import Event, live_ranges

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20


@pytest.fixture(autouse=True)
def host_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """`check` collects live facts: the fixture's two GPUs, without nvidia-smi."""
    monkeypatch.setattr(liveenv, "_smi_gpus", lambda: smi_rows(2))


@pytest.fixture
def loadable(tmp_path: Path) -> Path:
    return write_loadable_archive(tmp_path / "archive")


def run_cli(*args: str) -> tuple[int, str, str]:
    """`graphpersist ARGS` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(args))
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def load_stage(root: Path, rank: int) -> None:
    """A rank's LOAD up to its first GPU call (ArchiveError when it refuses)."""
    archive = open_archive(root, keep_rank=rank)
    layout.saved_phases(archive, rank)  # use_layout's read, before setup
    loadstage.rank_stage(archive, rank)


def edit_json(root: Path, rel: str, change: Callable[[Any], None]) -> None:
    """A forger's edit: the file changed, and every digest on its way up recomputed."""
    doc = json.loads((root / rel).read_bytes())
    change(doc)
    forge(root, rel, json.dumps(doc, indent=2).encode())


def refused_everywhere(root: Path, rank: int, says: str) -> None:
    """`check` exits 2 naming the problem, and that rank's LOAD refuses it at its CPU stage."""
    code, out, err = run_cli("check", str(root))
    assert code == 2, out + err
    assert says in err, err
    with pytest.raises(ArchiveError, match=re.escape(says)):
        load_stage(root, rank)


# ------------------------------------------------------------------------------------------------------ item 3


def test_comparing_tens_of_thousands_of_facts_is_linear(loadable: Path) -> None:
    """Facts past the caps never reach the comparison; the comparison itself is linear all the same (before: 30k
    flags took 6 s per call, 100k 72 s, in evaluate's list of what was not checked)."""
    archive = open_archive(loadable)
    flags = {f"pad{i}": i for i in range(30_000)}
    padded = dataclasses.replace(archive.manifest.world, flags=flags)
    big = Archive(archive.root, dataclasses.replace(archive.manifest, world=padded), {r: archive.rank_facts(r) for r in
                  archive.ranks})  # fmt: skip
    live = live_for(0)
    live["flags"] = dict(flags)
    started = time.process_time()  # CPU time: what the comparison costs, whatever else the host runs
    for skip_unknown in (False, True):
        assert evaluate(big, live, 0, skip_unknown=skip_unknown).mismatches == []
    assert time.process_time() - started < 2.0


def pad_flags(root: Path, n: int) -> None:
    """n flags more in manifest.json, rank 0's commitment to it recomputed: only the cap can refuse it."""
    manifest = json.loads((root / "manifest.json").read_bytes())
    manifest["world"]["flags"].update({f"pad{i}": i for i in range(n)})
    forge(root, "manifest.json", json.dumps(manifest).encode())


def test_a_manifest_padded_with_100k_flags_is_refused_fast(loadable: Path) -> None:
    pad_flags(loadable, 100_000)
    started = time.process_time()  # CPU time, as above
    code, _out, err = run_cli("check", str(loadable))
    assert code == 2 and f"more than the {MAX_FLAGS} flags an archive may record (MAX_FLAGS)" in err, err
    with pytest.raises(ArchiveError, match=r"MAX_FLAGS"):
        open_archive(loadable, keep_rank=1)
    assert time.process_time() - started < 2.0


def test_a_padded_manifest_under_the_cap_loads() -> None:
    facts = world(**{f"flags.f{i}": i for i in range(MAX_FLAGS - 1)})
    assert len(codec.from_dict(World, facts).flags) == MAX_FLAGS


@pytest.mark.parametrize(
    ("change", "cap"),
    [
        (lambda w: w["env"].update({f"PIN_{i}": "1" for i in range(MAX_ENV + 1)}), "MAX_ENV"),
        (lambda w: w["flags"].update({"nested": {f"f{i}": i for i in range(MAX_FLAGS + 1)}}), "MAX_FLAGS"),
        (lambda w: w["flags"].update({"x" * (MAX_FIELD_NAME + 1): 1}), "MAX_FIELD_NAME"),
        (lambda w: w["env"].update({"NCCL_ALGO": "r" * (MAX_FIELD_BYTES + 1)}), "MAX_FIELD_BYTES"),
        (lambda w: w["flags"].update({"sizes": list(range(MAX_FIELD_BYTES // 2))}), "MAX_FIELD_BYTES"),
        (lambda w: w["model"].update(dtype="d" * (MAX_FIELD_BYTES + 1)), "MAX_FIELD_BYTES"),
    ],
    ids=["env count", "nested flags", "name length", "env value", "flag value", "string fact"],
)
def test_each_cap_on_the_world_facts_is_named(change: Callable[[dict[str, Any]], None], cap: str) -> None:
    facts = world()
    change(facts)
    with pytest.raises(ManifestError, match=rf"\({cap}\)$"):
        codec.from_dict(World, facts)


def test_save_refuses_world_facts_past_a_cap(tmp_path: Path) -> None:
    facts = world(**{f"flags.f{i}": i for i in range(MAX_FLAGS + 1)})
    with pytest.raises(ArchiveError, match=r"invalid world facts: .*\(MAX_FLAGS\)"):
        ArchiveWriter(tmp_path / "archive", facts)


def test_a_manifest_edited_without_rehashing_is_refused(loadable: Path) -> None:
    manifest = json.loads((loadable / "manifest.json").read_bytes())
    manifest["world"]["flags"]["enforce_eager"] = True  # manifest.json is in no file table: only rank 0 commits to it
    (loadable / "manifest.json").write_text(json.dumps(manifest, indent=2))
    says = "manifest.json does not hash to rank_0/rank.json's extra.digests.manifest"
    for keep_rank in (None, 0, 1):
        with pytest.raises(ArchiveError, match=says):
            open_archive(loadable, keep_rank=keep_rank)
    with pytest.raises(ArchiveError, match=says):
        read_shared(loadable, jitcache.SHARED_NAME)


def test_the_creation_info_is_left_out_of_rank_0s_commitment(loadable: Path) -> None:
    """Two SAVEs of the same content write the same records: the time and host of a SAVE are shown, never compared."""
    manifest = json.loads((loadable / "manifest.json").read_bytes())
    manifest["created"]["created_at"] = "2030-01-01T00:00:00+00:00"
    (loadable / "manifest.json").write_text(json.dumps(manifest, indent=2))
    assert open_archive(loadable).manifest.created.created_at == "2030-01-01T00:00:00+00:00"


# ------------------------------------------------------------------------------------------------------ item 5


def test_stripped_digests_do_not_let_a_changed_parameter_byte_through(loadable: Path) -> None:
    index = json.loads((loadable / "rank_0/graphs/index.json").read_bytes())
    offset, _length = index["graphs"][0]["params"]
    pack = bytearray((loadable / "rank_0/graphs/pack.bin").read_bytes())
    pack[offset] ^= 0xFF
    (loadable / "rank_0/graphs/pack.bin").unlink()
    (loadable / "rank_0/graphs/pack.bin").write_bytes(bytes(pack))
    record = json.loads((loadable / "rank_0/rank.json").read_bytes())
    del record["extra"]["digests"]
    (loadable / "rank_0/rank.json").write_text(json.dumps(record, indent=2))
    manifest = json.loads((loadable / "manifest.json").read_bytes())
    for rel in ("rank_0/graphs/pack.bin", "rank_0/rank.json"):  # the file table regenerated to match
        data = (loadable / rel).read_bytes()
        manifest["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (loadable / "manifest.json").write_text(json.dumps(manifest, indent=2))
    refused_everywhere(loadable, 0, "rank_0/rank.json has no extra.digests")


# ------------------------------------------------------------------------------------------------------ item 4


def _tar(*members: Member) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, None if data is None else io.BytesIO(data))
    return out.getvalue()


Member = tuple[tarfile.TarInfo, bytes | None]


def _member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"x", **fields: Any) -> Member:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    for key, value in fields.items():
        setattr(info, key, value)
    return info, data if kind == tarfile.REGTYPE else None


_GOOD = _tar(_member("triton/k/kernel.bin"))
HOSTILE_TARS = {
    "symlink": _tar(_member("triton/l", tarfile.SYMTYPE, linkname="/etc/passwd")),
    "hard link": _tar(_member("triton/l", tarfile.LNKTYPE, linkname="triton/k/kernel.bin")),
    "device": _tar(_member("triton/d", tarfile.CHRTYPE)),
    "fifo": _tar(_member("triton/f", tarfile.FIFOTYPE)),
    "dot-dot": _tar(_member("triton/../../x")),
    "absolute": _tar(_member("/triton/x")),
    "no cache folder": _tar(_member("x")),
    "garbage": b"garbage, not a tar" * 64,
    "truncated": _GOOD[:700],
    "gzip": gzip.compress(_GOOD),
    "NaN time": _tar(_member("triton/n", pax_headers={"mtime": "nan"})),
    "time past 2**63 ns": _tar(_member("triton/h", mtime=10**20)),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_TARS))
def test_check_refuses_the_jit_caches_load_refuses(loadable: Path, tmp_path: Path, name: str) -> None:
    blob = HOSTILE_TARS[name]
    forge(loadable, jitcache.SHARED_NAME, blob)
    code, out, err = run_cli("check", str(loadable))
    assert code == 2 and "jitcache.tar: the archive's JIT caches" in err, out + err
    with pytest.raises(JitCacheError):  # what each rank's engine does with them before LOAD
        jitcache.restore(read_shared(loadable, jitcache.SHARED_NAME) or b"", {"triton": tmp_path / "triton"})
    assert not (tmp_path / "triton").exists() or not any((tmp_path / "triton").rglob("*"))


def test_check_accepts_the_jit_caches_load_restores(loadable: Path, tmp_path: Path) -> None:
    forge(loadable, jitcache.SHARED_NAME, _GOOD)
    code, out, err = run_cli("check", str(loadable))
    assert code != 2 and "shared jitcache.tar" in out, out + err
    assert jitcache.validate(_GOOD) == 1
    assert jitcache.restore(_GOOD, {"triton": tmp_path / "t"}).files == {"triton": 1}


def _set_event(i: int, row: list[Any]) -> Callable[[Any], None]:
    return lambda log: log.__setitem__(i, row)


LOGS = {
    "an event past the region": (lambda log: log.append(["alloc", REGION_BASE + REGION_SIZE, 2 * MIB, 2 * MIB]),
                                 "lies outside the region"),
    "an event below the region": (_set_event(2, ["alloc", REGION_BASE - 8 * MIB, 8 * MIB, 8 * MIB]),
                                  "lies outside the region"),
    "an outside event": (lambda log: log.append(["outside", 0x1000, 4096, 4096]), "SAVE refuses any such event"),
    "a refused event": (lambda log: log.append(["refused", 0, 0, 4096]), "SAVE refuses any such event"),
    "a capture-time reservation": (_set_event(2, ["reserve", REGION_BASE + 96 * MIB, 8 * MIB, 8 * MIB]),
                                   "is not restorable"),
    "an event after a post-capture phase": (lambda log: log.append(["alloc", REGION_BASE + 106 * MIB, 2 * MIB,
                                                                    2 * MIB]), "after a post-capture phase began"),
    "a graph address freed": (_set_event(2, ["alloc", REGION_BASE + 200 * MIB, 8 * MIB, 8 * MIB]),
                              "lies in no memory the allocation log leaves live"),
    "a kind in other digits": (_set_event(2, ["²", REGION_BASE + 96 * MIB, 8 * MIB, 8 * MIB]), "unknown kind"),
}  # fmt: skip
PHASES = {
    "two phases of one name": (lambda ph: ph[1].update(name="(setup)"), "a second phase of that name"),
    "overlapping phases": (lambda ph: ph[1].update(start_event=0), "before the end of the phase before"),
    "an anchor before the last limit": (lambda ph: ph[1].update(start=MIB), "before the end of the phase before"),
    "a limit past the region": (lambda ph: ph[2].update(limit=2 * REGION_SIZE), "lies past the region's"),
    "setup after post-capture": (lambda ph: ph.append({**ph[2], "name": "late", "post_capture": False,
                                                       "start_event": 4, "end_event": 4, "start": 106 * MIB,
                                                       "end": 106 * MIB, "limit": 106 * MIB}),
                                 "a setup phase after a post-capture phase"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(LOGS))
def test_check_refuses_the_allocation_logs_load_refuses(loadable: Path, name: str) -> None:
    change, says = LOGS[name]
    edit_json(loadable, "rank_1/alloc_log.json", change)
    refused_everywhere(loadable, 1, says)


@pytest.mark.parametrize("name", sorted(PHASES))
def test_check_refuses_the_phases_load_refuses(loadable: Path, name: str) -> None:
    change, says = PHASES[name]
    edit_json(loadable, "rank_1/rank.json", lambda r: change(r["extra"]["phases"]))
    refused_everywhere(loadable, 1, says)


def _spec(**fields: Any) -> Callable[[Any], None]:
    return lambda index: index["graphs"][0]["inputs"][0].update(fields)


VALUES = {
    "dtype complex": (_spec(dtype="complex"), "is not a torch dtype name"),
    "dtype float_power": (_spec(dtype="float_power"), "is not a torch dtype name"),
    "dtype floatx": (_spec(dtype="floatx"), "is not a torch dtype name"),
    "a tensor past the region": (_spec(shape=[1 << 40, 1 << 40], stride=[1 << 40, 1]), "run past the region"),
    "a function attribute ²": (lambda index: index["funcs"][1][2].update({"²": 1}), "attributes must map attribute"),
    "a function attribute the driver cannot set": (lambda index: index["funcs"][1][2].update({"99": 1}),
                                                    "attributes must map attribute"),
    "an edges key": (lambda index: index["descs"][0].update(edges=[[0, "x", 0, 0, 0]]), "unknown keys ['edges']"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(VALUES))
def test_check_refuses_the_values_load_cannot_use(loadable: Path, name: str) -> None:
    change, says = VALUES[name]
    edit_json(loadable, "rank_0/graphs/index.json", change)
    refused_everywhere(loadable, 0, says)


NOTES = {  # the sections of an engine's notes whose form the runtime knows (graphpersist.archive.notedsections)
    "a piece's key that is no string": (
        {"compiled_model": {"backbone": {"folder": "h/m", "pieces": [["submod_0", [1], True, {"1-8": 7}]]}}},
        "extra.engine_notes.compiled_model['backbone']: saved {'folder': 'h/m', 'pieces': [['submod_0', [1], True, "
        "{'1-8': 7}]]}, expected {'folder': a string",
    ),
    "a compiled model's piece of another shape": (
        {"compiled_model": {"backbone": {"folder": "h/rank_0_0/backbone", "pieces": [["submod_0", ["1"], True, {}]]}}},
        "extra.engine_notes.compiled_model['backbone']: saved {'folder': 'h/rank_0_0/backbone', 'pieces': "
        "[['submod_0', ['1'], True, {}]]}, expected {'folder': a string",
    ),
    "compiled models that are no object": (
        {"compiled_model": ["backbone"]},
        "extra.engine_notes.compiled_model: saved ['backbone'], expected an object of compiled models by name",
    ),
}


@pytest.mark.parametrize("name", sorted(NOTES))
def test_check_refuses_the_engine_notes_load_refuses(loadable: Path, name: str) -> None:
    """vLLM's glue refuses these entries at LOAD (graphpersist_compiled); `check`, without the engine, refuses them too,
    naming the entry and its saved value."""
    from graphpersist.archive import notedsections
    from graphpersist.errors import PersistError

    notes, says = NOTES[name]
    section = next(iter(notes))
    with pytest.raises(PersistError, match=re.escape(says.removeprefix("extra.engine_notes."))):
        notedsections.READERS[section](section, notes[section])  # what the glue calls at LOAD
    edit_json(loadable, "rank_1/rank.json", lambda r: r["extra"].update(engine_notes=notes))
    refused_everywhere(loadable, 1, says)


def test_check_accepts_well_formed_engine_notes(loadable: Path) -> None:
    notes = {
        "compiled_model": {
            "backbone": {"folder": "h/rank_0_0/backbone", "pieces": [["submod_0", [1], True, {"1-8": "k"}]]}
        },
    }
    edit_json(loadable, "rank_1/rank.json", lambda r: r["extra"].update(engine_notes=notes))
    code, out, err = run_cli("check", str(loadable))
    assert code != 2 and "payloads verified" in out, out + err  # 1: this host is not the archive's
    load_stage(loadable, 1)  # LOAD's CPU stage takes them too
    assert open_archive(loadable).rank_facts(1).engine_notes() == notes


def test_a_kernel_attribute_key_in_other_digits_is_refused(loadable: Path) -> None:
    from graphpersist.graph import format as graphformat

    assert graphformat.attr_id("7") and not graphformat.attr_id("²") and not graphformat.attr_id("٣")
    node = {"type": "kernel", "func": 0, "name": "k", "image": "i", "grid": [1, 1, 1], "block": [1, 1, 1], "smem": 0,
            "layout": [], "params": [0, 0], "attrs": {"²": "00"}}  # fmt: skip
    assert "attributes must map attribute numbers" in (graphformat.kernel_node_problem(0, node, 0, 1) or "")


def test_check_runs_loads_cpu_stage_for_every_rank(loadable: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, bool]] = []
    stage = loadstage.rank_stage

    def recorded(archive: Archive, rank: int, **kwargs: Any) -> Any:
        calls.append((rank, kwargs.get("every_byte", False)))
        return stage(archive, rank, **kwargs)

    monkeypatch.setattr(loadstage, "rank_stage", recorded)
    code, out, err = run_cli("check", str(loadable))
    assert code != 2 and calls == [(0, True), (1, True)], out + err
    # load() needs torch to import: that its rank's LOAD calls the same stage is read from its source
    assert "loadstage.rank_stage(" in (Path(loadstage.__file__).parent / "load.py").read_text()


def _naive_live_ranges(evs: list[Event]) -> list[tuple[int, int]]:
    """What live_ranges computed before it swept (each unmap looked at every live mapping): the semantics it keeps."""
    live: dict[int, int] = {}
    for e in evs:
        if e.kind in ("alloc", "map_fixed", "ipc_open", "lib_map"):
            live[e.addr] = e.size
        elif e.kind in ("free", "ipc_close"):
            live.pop(e.addr, None)
        elif e.kind in ("lib_unmap", "unreserve"):
            for a in [a for a in live if e.addr <= a < e.addr + e.size]:
                del live[a]
    return sorted(live.items())


def test_live_ranges_of_a_padded_log_are_linear_and_unchanged() -> None:
    kinds = ["alloc", "map_fixed", "ipc_open", "lib_map", "free", "ipc_close", "lib_unmap", "unreserve", "reserve"]
    rng = random.Random(41)
    for _ in range(2000):
        evs = [Event(i, rng.choice(kinds), rng.randrange(40), rng.randrange(12), 0) for i in range(rng.randrange(60))]
        assert live_ranges(evs) == _naive_live_ranges(evs), evs
    n = 100_000  # n mappings, then n unmaps of nothing: n squared before (minutes)
    evs = [Event(i, "lib_map", REGION_BASE + 4096 * i, 4096, 0) for i in range(n)]
    evs += [Event(n + i, "lib_unmap", REGION_BASE, 0, 0) for i in range(n)]
    started = time.process_time()
    assert len(live_ranges(evs)) == n
    assert time.process_time() - started < 2.0


# ------------------------------------------------------------------------------------------------------ item 8


def test_the_demo_archive_is_checked_as_load_reads_it(tmp_path: Path) -> None:
    """The README's demo archive (archive_fixtures.py run as a script) is one `check` verifies, not one it refuses
    for a missing allocation log."""
    env = {"PYTHONPATH": str(REPO / "overlays" / "graphpersist"), "PYTHONDONTWRITEBYTECODE": "1"}
    made = subprocess.run([sys.executable, "tests/cpu/archive_fixtures.py", str(tmp_path / "demo")], cwd=REPO, env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert made.stdout.strip() == str(tmp_path / "demo")
    code, out, err = run_cli("check", str(tmp_path / "demo"))
    assert code != 2 and "payloads verified: 8 graphs" in out, out + err


def test_inspect_of_a_missing_rank_names_the_ranks(loadable: Path) -> None:
    code, out, err = run_cli("inspect", "--rank", "5", str(loadable))
    assert code == 2 and err.strip() == f"graphpersist inspect: {loadable} has no rank 5; ranks 0, 1", out + err
    assert "cannot open archive" not in err


def test_a_mistyped_option_prints_the_subcommands_usage_and_the_closest_option(loadable: Path) -> None:
    code, _out, err = run_cli("check", str(loadable), "--rnak", "1")
    assert code == 2
    assert err.startswith("usage: graphpersist check ") and "--rnak: did you mean --rank?" in err, err
    code, _out, err = run_cli("inspect", str(loadable), "--jsn")
    assert code == 2 and err.startswith("usage: graphpersist inspect ") and "did you mean --json?" in err, err


def test_the_readme_shows_that_diff_takes_two_archives() -> None:
    readme = (REPO / "README.md").read_text()
    assert "graphpersist diff A B" in readme and "inspect|check|diff DIR" not in readme


def test_check_says_env_pins_are_read_from_its_own_shell(loadable: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("NCCL_NVLS_ENABLE", "NCCL_CUMEM_ENABLE"):  # the archive's pins, unset in this shell
        monkeypatch.delenv(name, raising=False)
    code, out, _err = run_cli("check", str(loadable))
    assert code == 1 and "env.NCCL_NVLS_ENABLE: saved '0', live <unset>" in out
    assert cli.ENV_ADVICE in out.splitlines()
    code, out, _err = run_cli("check", str(loadable), "--set", "env.NCCL_NVLS_ENABLE=1", "--set",
                              "env.NCCL_CUMEM_ENABLE=1")  # fmt: skip
    assert code == 1 and cli.ENV_ADVICE not in out  # given with --set: not this shell's


def test_make_help_does_not_promise_test_fast_in_under_a_minute() -> None:
    line = next(s for s in (REPO / "Makefile").read_text().splitlines() if s.startswith("test-fast:"))
    assert "< 1 min" not in line and "2 cores" in line
