"""Hostile, damaged and moving archives as a user meets them, and the first hour with `graphpersist` (issue 33).

Each test pins one behaviour with a case that failed before it (commit 53c45dd), as the item numbers say:

 1  test_a_sparse_file_claiming_16_gib_is_refused_before_a_byte_is_read
 2  test_the_layout_readers_refuse_mistyped_records_naming_file_and_field,
    test_check_refuses_mistyped_load_inputs_naming_file_and_field
 3  test_check_verifies_each_graph_a_regenerated_file_table_would_pass, test_quick_check_says_it_skipped_the_payloads
 4  test_archive_strings_reach_the_terminal_escaped
 5  test_diff_of_a_2_rank_and_a_4_rank_archive_is_a_difference
 6  test_an_archive_replaced_while_it_is_read_is_read_again, test_an_archive_replaced_on_every_read_says_so,
    test_a_full_disk_during_save_names_the_path_the_bytes_and_what_to_do, test_a_read_only_file_system_during_save
 7  test_only_drift_advises_a_new_save, test_unreadable_files_advise_permissions
 8  test_check_on_a_host_without_gpu_facts_says_it_could_not_check_and_exits_3, test_help_documents_the_exit_codes
 9  test_set_refuses_an_unknown_field_and_lists_the_valid_ones
"""

from __future__ import annotations

import builtins
import errno
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from archive_fixtures import forge, write_archive, write_loadable_archive

from graphpersist.archive import ArchiveError, ArchiveWriter, open_archive
from graphpersist.archive import read as archive_read
from graphpersist.archive.validate import LoadRefused, evaluate
from graphpersist.memory import layout

REPO = Path(__file__).resolve().parents[2]
CONTROL = ("\x1b", "\r", "\x07", "\x9b", "\u202e")  # ESC, CR, BEL, CSI (C1), right-to-left override


def graphpersist(*args: str, path: str | None = None, **pins: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO / "overlays" / "graphpersist"), PYTHONDONTWRITEBYTECODE="1", **pins)
    if path is not None:
        env["PATH"] = path
    return subprocess.run([sys.executable, "-m", "graphpersist", *args], env=env, capture_output=True, text=True,
                          cwd=REPO, timeout=120)  # fmt: skip


def edit_json(root: Path, rel: str, change: Callable[[Any], None]) -> None:
    """Changes one JSON file as a forger would (forge: its table entry and the record committing to it match)."""
    doc = json.loads((root / rel).read_bytes())
    change(doc)
    forge(root, rel, json.dumps(doc, indent=2).encode())


def edit_manifest(root: Path, change: Callable[[Any], None]) -> None:
    """Changes manifest.json as a forger would (forge: rank 0's commitment to it made to match)."""
    doc = json.loads((root / "manifest.json").read_bytes())
    change(doc)
    forge(root, "manifest.json", json.dumps(doc, indent=2).encode())


@pytest.fixture
def loadable(tmp_path: Path) -> Path:
    return write_loadable_archive(tmp_path / "archive")


# ------------------------------------------------------------------------------------------------------ item 1


def test_a_sparse_file_claiming_16_gib_is_refused_before_a_byte_is_read(loadable: Path) -> None:
    """The table and the file agree on 16 GiB (a sparse file): refused by size, at once, in no more memory than it
    takes to say so (the reader runs with 2 GiB of address space: reading the file whole would fail)."""
    pack = loadable / "rank_0" / "graphs" / "pack.bin"
    with open(pack, "r+b") as fh:
        fh.truncate(16 << 30)
    edit_manifest(loadable, lambda m: m["files"]["rank_0/graphs/pack.bin"].update(size=16 << 30))
    probe = textwrap.dedent(f"""
        import time
        from graphpersist.archive import ArchiveError, open_archive
        for keep in (None, 0):
            start = time.process_time()
            try:
                open_archive({str(loadable)!r}, keep_rank=keep)
            except ArchiveError as exc:
                print(round(time.process_time() - start, 3), str(exc).splitlines()[0])
    """)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    env = dict(os.environ, PYTHONPATH=str(REPO / "overlays" / "graphpersist"))
    ran = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120,
                         preexec_fn=limit)  # fmt: skip
    assert ran.returncode == 0 and "Traceback" not in ran.stderr, ran.stderr[-2000:]
    lines = ran.stdout.splitlines()
    assert len(lines) == 2, ran.stdout
    for line in lines:
        seconds, message = line.split(" ", 1)
        assert float(seconds) < 0.5, line
        assert "rank_0/graphs/pack.bin" in message and "more than an archive file may hold" in message


# ------------------------------------------------------------------------------------------------------ item 2


@pytest.mark.parametrize(
    ("rel", "change", "names"),
    [
        ("rank_0/rank.json", lambda d: d["extra"].update(phases="all of them"), "extra.phases"),
        ("rank_0/rank.json", lambda d: d["extra"].update(phases=[7]), "extra.phases[0]"),
        ("rank_0/rank.json", lambda d: d["extra"]["phases"][1].update(start="0x4000000"), "extra.phases[1].start"),
        (
            "rank_0/rank.json",
            lambda d: d["extra"].pop("phases") and d["extra"].update(setup_events="2"),
            "extra.setup_events",
        ),
        ("rank_0/alloc_log.json", lambda d: d.append(["alloc", 1]), "event 4"),
        ("rank_0/alloc_log.json", lambda d: d[0].__setitem__(1, "0x7e00"), "event 0 address"),
        ("rank_0/alloc_log.json", lambda d: d.__setitem__(0, {"kind": "alloc"}), "event 0"),
    ],
)
def test_the_layout_readers_refuse_mistyped_records_naming_file_and_field(
    loadable: Path, rel: str, change: Callable[[Any], None], names: str
) -> None:
    """use_layout() and LOAD's memory restore read the phases and the allocation log (layout.saved_phases)."""
    edit_json(loadable, rel, change)
    with pytest.raises(ArchiveError) as info:
        layout.saved_phases(open_archive(loadable), 0)
    assert f"{rel}: {names}" in str(info.value)


@pytest.mark.parametrize(
    ("rel", "change", "names"),
    [
        ("rank_0/rank.json", lambda d: d["extra"].update(state=[{"name": "x"}]), "extra.state[0]"),
        ("rank_0/rank.json", lambda d: d["extra"].update(torch_blocks=[["0x1", 4]]), "extra.torch_blocks[0][0]"),
        ("rank_0/rank.json", lambda d: d["extra"].update(engine_notes=["not", "an", "object"]), "extra.engine_notes"),
        ("rank_1/setup_tensors.json", lambda d: d[0].__setitem__(3, "1024x64"), "tensor 0.shape"),
        ("rank_1/graphs/index.json", lambda d: d["graphs"][0]["inputs"].append(7), "inputs[1]"),
        ("rank_1/graphs/index.json", lambda d: d["graphs"][2].update(outputs={"kind": "tensor"}), "outputs"),
    ],
)
def test_check_refuses_mistyped_load_inputs_naming_file_and_field(
    loadable: Path, rel: str, change: Callable[[Any], None], names: str
) -> None:
    edit_json(loadable, rel, change)
    result = graphpersist("check", str(loadable))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    first = result.stderr.splitlines()[0]
    assert rel in first and names in first, result.stderr


# ------------------------------------------------------------------------------------------------------ item 3


def _flip_params_of(root: Path, graph: str) -> None:
    """One bit of `graph`'s kernel parameters changed in the pack; the index (and its per-graph hashes) untouched."""
    index = json.loads((root / "rank_0" / "graphs" / "index.json").read_bytes())
    offset = next(g["params"][0] for g in index["graphs"] if g["name"] == graph)
    data = bytearray((root / "rank_0" / "graphs" / "pack.bin").read_bytes())
    data[offset + 3] ^= 0x10
    forge(root, "rank_0/graphs/pack.bin", bytes(data))


def test_check_verifies_each_graph_a_regenerated_file_table_would_pass(loadable: Path) -> None:
    _flip_params_of(loadable, "full-bs4")
    result = graphpersist("check", str(loadable))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "rank_0/graphs/index.json: graph 'full-bs4': parameter file content does not match its recorded sha256" \
        in result.stderr  # fmt: skip


def test_a_payload_changed_and_the_table_regenerated_is_refused_by_its_record(loadable: Path) -> None:
    """Only the table regenerated (no forger's care for the records): the record's commitment refuses it."""
    log = loadable / "rank_1" / "alloc_log.json"
    log.write_bytes(log.read_bytes().replace(b'"alloc"', b'"free"', 1))  # still a valid log: a changed one
    edit_manifest(loadable, lambda m: m["files"].update({"rank_1/alloc_log.json": _entry(loadable, log)}))
    for command in ("check", "inspect"):
        result = graphpersist(command, str(loadable))
        assert result.returncode == 2, result.stdout + result.stderr
        assert "rank_1/alloc_log.json: sha256" in result.stderr and "rank_1/rank.json" in result.stderr


def _entry(root: Path, path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def test_quick_check_says_it_skipped_the_payloads(loadable: Path) -> None:
    _flip_params_of(loadable, "full-bs4")
    result = graphpersist("check", "--quick", str(loadable))
    assert result.returncode in (0, 1, 3), result.stdout + result.stderr
    assert "payloads not verified (--quick)" in result.stdout


# ------------------------------------------------------------------------------------------------------ item 4


def test_archive_strings_reach_the_terminal_escaped(loadable: Path, tmp_path: Path) -> None:
    evil = "bs1\x1b[2J\x1b]0;owned\x07\rfits\nforged line\u202e\x9b31m"
    for rel in ("rank_0/graphs/index.json", "rank_0/rank.json"):
        edit_json(loadable, rel, lambda d: d["graphs"][0].update(name=evil))
    edit_manifest(loadable, lambda m: (m["world"]["env"].update({"NCCL_\x1b[31mX": "1\x1b[0m"}),
                                       m["created"].update(host="host\x1b]2;title\x07"),
                                       m["world"]["flags"].update({"f\rlag": True})))  # fmt: skip
    other = write_loadable_archive(tmp_path / "other")
    runs = [
        graphpersist("inspect", str(loadable)),
        graphpersist("inspect", "--json", str(loadable)),
        graphpersist("check", "--quick", str(loadable), "--set", "model.dtype=float16"),
        graphpersist("diff", str(loadable), str(other)),
    ]
    for run in runs:
        assert run.returncode in (0, 1, 3), run.stdout + run.stderr
        text = run.stdout + run.stderr
        assert not [c for c in CONTROL if c in text], f"raw control characters in: {text[:2000]!r}"
        assert "\nforged line" not in text and "\nfits" not in text
    assert "bs1\\x1b[2J" in runs[0].stdout  # shown, escaped
    json.loads(runs[1].stdout)  # still JSON


# ------------------------------------------------------------------------------------------------------ item 5


def test_diff_of_a_2_rank_and_a_4_rank_archive_is_a_difference(tmp_path: Path) -> None:
    two = write_loadable_archive(tmp_path / "tp2")
    four = write_loadable_archive(tmp_path / "tp4", **{"parallel.world_size": 4, "parallel.tp_size": 4})
    result = graphpersist("diff", str(two), str(four))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "ranks differ: A has 2 ([0, 1]), B has 4 ([0, 1, 2, 3]); only in A [], only in B [2, 3]" in result.stdout
    assert "  parallel.world_size: A 2, B 4" in result.stdout
    assert "are equal" not in result.stdout


# ------------------------------------------------------------------------------------------------------ item 6


def _replace_while_reading(monkeypatch: pytest.MonkeyPatch, root: Path, new: Path, times: int) -> list[int]:
    """Replaces the archive at `root` by `new` (as a SAVE does: renames) at the reader's first payload lookup, on
    `times` reads; returns the count of replacements made."""
    original = archive_read._listed_file
    done = [0]
    spare = root.with_name(root.name + ".old")

    def listed(folder: Path, rel: str) -> tuple[str | None, int]:
        if done[0] < times and rel == "rank_0/graphs/pack.bin":  # once per read of the archive
            done[0] += 1
            os.rename(root, spare)
            os.rename(new, root)
            os.rename(spare, new)
        return original(folder, rel)

    monkeypatch.setattr(archive_read, "_listed_file", listed)
    return done


def test_an_archive_replaced_while_it_is_read_is_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = write_loadable_archive(tmp_path / "archive")
    new = write_loadable_archive(tmp_path / "new", shared_image=b"other kernels", **{"model.dtype": "float16"})
    done = _replace_while_reading(monkeypatch, root, new, times=1)
    archive = open_archive(root)
    assert done == [1] and archive.manifest.world.model.dtype == "float16"


def test_an_archive_replaced_on_every_read_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = write_loadable_archive(tmp_path / "archive")
    new = write_loadable_archive(tmp_path / "new", shared_image=b"other kernels", **{"model.dtype": "float16"})
    _replace_while_reading(monkeypatch, root, new, times=10)
    with pytest.raises(ArchiveError) as info:
        open_archive(root)
    message = str(info.value)
    assert "it changed while it was read, twice: a SAVE is replacing it right now" in message
    assert "corrupted" not in message and "mode=save" not in message
    assert message.splitlines()[-1].startswith("A SAVE replaced the archive while it was read")


def _fail_on(monkeypatch: pytest.MonkeyPatch, module: Any, name: str, error: int) -> None:
    real = getattr(module, name)

    def failing(*args: Any, **kwargs: Any) -> Any:
        if name != "fsync" or os.path.isfile(f"/proc/self/fd/{args[0]}"):
            raise OSError(error, os.strerror(error))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, failing)


def test_a_full_disk_during_save_names_the_path_the_bytes_and_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from archive_fixtures import world

    writer = ArchiveWriter(tmp_path / "archive", world())
    _fail_on(monkeypatch, os, "fsync", errno.ENOSPC)
    with pytest.raises(ArchiveError) as info:
        writer.add_file(0, "graphs/pack.bin", b"x" * 123456)
    message = str(info.value)
    assert f"{writer.staging}/rank_0/graphs/pack.bin: No space left on device" in message
    assert "this file needs 123456 bytes" in message and "bytes are free there" in message
    assert message.splitlines()[-1].startswith("Free that much space there")
    assert not (writer.staging / "rank_0" / "graphs" / "pack.bin").exists(), "no half-written file stays"
    writer.abort()


def test_a_read_only_file_system_during_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from archive_fixtures import world

    def read_only(self: Path, *args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(ArchiveError) as info:
        ArchiveWriter(tmp_path / "archive", world())
    message = str(info.value)
    assert "cannot create the staging folder" in message and "Read-only file system" in message
    assert message.splitlines()[-1].startswith("Give the SAVE an archive folder on a writable file system")


# ------------------------------------------------------------------------------------------------------ item 7


def test_only_drift_advises_a_new_save(loadable: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "damaged"
    shutil.copytree(loadable, damaged)
    data = bytearray((damaged / "rank_1" / "graphs" / "pack.bin").read_bytes())
    data[10] ^= 1
    (damaged / "rank_1" / "graphs" / "pack.bin").write_bytes(bytes(data))
    with pytest.raises(ArchiveError) as info:
        open_archive(damaged)
    advice = str(info.value).splitlines()[-1]
    assert "mode=save" not in advice and "copy the archive again" in advice
    unfinished = tmp_path / "unfinished"
    shutil.copytree(loadable, unfinished)
    (unfinished / "manifest.json").unlink()
    with pytest.raises(ArchiveError) as info:
        open_archive(unfinished)
    assert "mode=save" not in str(info.value).splitlines()[-1]
    live = {"model": {"dtype": "float16"}}
    drift = LoadRefused(loadable, evaluate(open_archive(loadable), live, 0, skip_unknown=True).mismatches, 0)
    assert str(drift).splitlines()[-1] == "Re-run with mode=save for this configuration."


def test_unreadable_files_advise_permissions(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    root = write_archive(tmp_path / "archive")
    denied = str(root / "rank_0" / "allocations.log")
    real_open, real_os_open = builtins.open, os.open

    def guard(path: Any) -> None:
        if os.fspath(path) == denied:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), denied)

    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: guard(path) or real_open(path, *a, **k))
    monkeypatch.setattr(os, "open", lambda path, *a, **k: guard(path) or real_os_open(path, *a, **k))
    with pytest.raises(ArchiveError) as info:
        open_archive(root)
    lines = str(info.value).splitlines()
    assert "cannot read rank_0/allocations.log: Permission denied" in lines[0]
    assert "mode=save" not in lines[-1] and "readable" in lines[-1]


# ------------------------------------------------------------------------------------------------------ item 8


def test_check_on_a_host_without_gpu_facts_says_it_could_not_check_and_exits_3(tmp_path: Path) -> None:
    """No nvidia-smi that answers (and, on CI, no torch): the host's facts cannot be measured, so nothing that
    matters was compared; `check` must not say the archive fits. The archive was saved by this graphpersist in
    this environment (its pins set as they are here), so nothing measurable differs."""
    from archive_fixtures import world

    from graphpersist import __version__

    archive = write_loadable_archive(tmp_path / "archive", **{"distribution.version": __version__})
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")
    (folder / "nvidia-smi").chmod(0o755)
    pins = {k: v for k, v in world()["env"].items() if v is not None}
    with pytest.MonkeyPatch.context() as patch:
        for key in world()["env"]:
            patch.delenv(key, raising=False)
        result = graphpersist("check", str(archive), path=f"{folder}{os.pathsep}/usr/bin:/bin", **pins)
    assert result.returncode == 3, result.stdout + result.stderr
    first = result.stdout.splitlines()[0]
    assert first.startswith(f"graphpersist: cannot tell whether archive {archive} fits this host for rank 0")
    assert "gpu.model" in first
    assert not [line for line in result.stdout.splitlines() if line.startswith(f"graphpersist: archive {archive} fits")]


def test_help_documents_the_exit_codes() -> None:
    for args in (["--help"], ["check", "--help"]):
        text = graphpersist(*args).stdout
        assert "exit codes:" in text and "3  check only: this host could not report the facts to compare" in text


# ------------------------------------------------------------------------------------------------------ item 9


def test_set_refuses_an_unknown_field_and_lists_the_valid_ones(loadable: Path) -> None:
    result = graphpersist("check", "--quick", str(loadable), "--set", "parallel.tp_szie=2")
    assert result.returncode == 2, result.stdout + result.stderr
    message = result.stderr.strip()
    assert message.startswith(
        "graphpersist check: --set parallel.tp_szie: no such field (did you mean parallel.tp_size?)"
    )
    assert "parallel.tp_size" in message and "model.dtype" in message and "env.NAME or flags.NAME" in message
    assert not result.stdout
    for taken in ("env.NCCL_ALGO=Ring", "flags.new_flag=1", "device.index=0", "parallel.tp_size=2"):
        assert graphpersist("check", "--quick", str(loadable), "--set", taken).returncode != 2, taken
