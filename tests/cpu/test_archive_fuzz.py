"""Hostile archives: whatever a folder holds, open_archive refuses it with ArchiveError or opens a sound archive.

Every case starts from a real archive written by the project's writer (archive_fixtures.write_archive) and
changes it: byte flips, truncations, deletions, added files, links and FIFOs, and JSON-level mutations of
manifest.json, rank.json and payload JSON (wrong types, huge integers, NaN/Infinity, deep nesting, missing,
extra, duplicate and renamed keys, escaping paths). Mutations of files the manifest checksums are, in most
cases, followed by a fixed-up file table (new sha256 and size), so they reach the parser instead of stopping
at the checksum.

What each case must do:

* never raise anything but ArchiveError (whose message is non-empty) from open_archive or Archive.read*;
* `must_fail` cases (hostile JSON anywhere in a record, changed bytes without a fixed-up table, missing or
  extra files, links, FIFOs) must be refused;
* the others may also open: a mutation can be harmless. What is allowed: a value changed to another of the
  right type (drift is LOAD's business, not open's), a new key inside a free-form field (`flags`, `extra`), an
  empty folder, a whitespace change. Unknown keys anywhere else are refused (records are strict). An archive
  that opens must then survive what `inspect`, `inspect --json` and `check` do with it, and payload reads
  must return data or raise ArchiveError.

A subset runs the real command (`python -m graphpersist check / inspect / inspect --json`) as a subprocess and
must exit 2 with the refusal on stderr and no traceback.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from archive_fixtures import live_for, write_archive

from graphpersist import cli
from graphpersist.archive import ArchiveError, open_archive
from graphpersist.archive.validate import evaluate

REPO = Path(__file__).resolve().parents[2]
SEED = 20261130
MIN_CASES = 1000
CLI_CASES = 30

# Raw JSON text no archive record may hold, wherever it lands (safejson strict refuses it). `payload`: also
# refused by Archive.read_json, which parses payloads without the per-object checks.
HOSTILE: dict[str, tuple[str, bool]] = {
    "huge int": ("9" * 5000, True),
    "huge negative int": ("-" + "7" * 4400, True),
    "int over 64 bits": (str(2**64), False),
    "NaN": ("NaN", True),
    "Infinity": ("Infinity", True),
    "-Infinity": ("-Infinity", True),
    "1e999": ("1e999", True),
    "deep list": ("[" * 100_000 + "]" * 100_000, True),
    "deep object": ('{"a":' * 40 + "1" + "}" * 40, False),
    "lone surrogate": ('"\\ud800"', False),
}
# Well-formed JSON of a possibly wrong type: refused where a field's type differs, harmless where it fits.
BENIGN: dict[str, str] = {
    "string": '"x"',
    "empty string": '""',
    "zero": "0",
    "negative": "-1",
    "largest 64-bit": str(2**64 - 1),
    "float": "1.5",
    "null": "null",
    "true": "true",
    "list": "[1, 2]",
    "object": '{"k": "v"}',
    "empty list": "[]",
    "empty object": "{}",
    "escaping path": '"../../etc/passwd"',
    "absolute path": '"/etc/passwd"',
    "long string": json.dumps("y" * 100_000),
    "surrogate pair": '"\\ud83d\\ude00"',
}
# File-table keys an archive must never use (or that name nothing real).
PATHS = [
    "../engine.json",
    "/etc/passwd",
    "rank_0/../engine.json",
    "rank_0//allocations.log",
    "./engine.json",
    "",
    "manifest.json",
    "rank_0\\allocations.log",
    "rank_9/rank.json",
    "rank_01/x",
    "rank_" + "9" * 5000 + "/x",
    "x" * 5000,
    "nul\0byte",
    "rank_0/images",
    "rank_0/allocations.log/x",
]


@dataclass(frozen=True)
class Case:
    name: str
    apply: Callable[[Path], None]
    must_fail: bool
    read_payloads: bool = False
    hostile_payload: str | None = None  # a payload file that holds a token Archive.read_json must refuse


@dataclass
class Pristine:
    root: Path
    files: list[str]  # every file, relative, manifest.json included
    manifest: dict[str, Any]
    records: dict[str, dict[str, Any]]  # rank_<r>/rank.json -> its JSON
    payload_json: list[str]  # JSON payload files (not records)


# --- mutations


def _paths(doc: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every path into a JSON tree (the root included), as tuples of keys and indices."""
    yield prefix
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            yield from _paths(value, (*prefix, i))


def _get(doc: Any, path: tuple) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def _render(doc: Any, raw: dict[str, str]) -> bytes:
    """JSON text of `doc`, with each placeholder string replaced by its raw text (tokens json.dumps cannot write)."""
    text = json.dumps(doc, indent=2, ensure_ascii=False)
    for placeholder, token in raw.items():
        assert f'"{placeholder}"' in text
        text = text.replace(f'"{placeholder}"', token)
    return text.encode("utf-8", "surrogatepass")


def _json_mutation(rng: random.Random, doc: Any) -> tuple[str, bytes, bool, bool]:
    """One random mutation of `doc`: (description, new bytes, hostile token used, payload refusal expected)."""
    doc = copy.deepcopy(doc)
    paths = list(_paths(doc))
    path = rng.choice(paths)
    target = _get(doc, path)
    raw: dict[str, str] = {}
    hostile = rng.random() < 0.45
    if hostile:
        label, (token, payload) = rng.choice(sorted(HOSTILE.items()))
    else:
        label, token = rng.choice(sorted(BENIGN.items()))
        payload = False
    raw["@@FUZZ@@"] = token
    ops = ["replace"]
    if isinstance(target, dict):
        ops += ["add key", "duplicate key", "delete key", "rename key"] if target else ["add key"]
    if isinstance(target, list) and target:
        ops += ["delete item", "append"]
    op = rng.choice(ops)
    where = "/".join(str(p) for p in path) or "<root>"
    if op == "replace":
        if path:
            _get(doc, path[:-1])[path[-1]] = "@@FUZZ@@"
        else:
            doc = "@@FUZZ@@"
    elif op == "add key":
        target["fuzz_extra"] = "@@FUZZ@@"
    elif op == "append":
        target.append("@@FUZZ@@")
    elif op == "duplicate key":
        key = rng.choice(sorted(target))
        target["@@DUPKEY@@"] = "@@FUZZ@@" if hostile or rng.random() < 0.5 else target[key]
        raw["@@DUPKEY@@"] = json.dumps(key, ensure_ascii=False)
        if target["@@DUPKEY@@"] != "@@FUZZ@@":
            del raw["@@FUZZ@@"]
            hostile, label = False, "same value"
        payload = False  # payload reads allow duplicate keys
    elif op == "delete key":
        key = rng.choice(sorted(target))
        del target[key]
        del raw["@@FUZZ@@"]
        hostile, label, payload, where = False, "-", False, f"{where}/{key}"
    elif op == "delete item":
        del target[rng.randrange(len(target))]
        del raw["@@FUZZ@@"]
        hostile, label, payload = False, "-", False
    else:  # rename key: to an unknown name, or (in the file table) to a path no archive may use
        key = rng.choice(sorted(target))
        new = rng.choice(PATHS) if path == ("files",) else f"{key}_renamed"
        target[new] = target.pop(key)
        del raw["@@FUZZ@@"]
        hostile, label, payload, where = False, repr(new[:40]), False, f"{where}/{key}"
    return f"{op} {where} -> {label}", _render(doc, raw), hostile, payload


def _fix_table(root: Path, rel: str, manifest: dict[str, Any]) -> None:
    """Records `rel`'s new sha256 and size in manifest.json, so a mutated file reaches its parser."""
    data = (root / rel).read_bytes()
    table = copy.deepcopy(manifest)
    table["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (root / "manifest.json").write_text(json.dumps(table, indent=2))


def _write(rel: str, data: bytes, fix: Pristine | None = None) -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        (root / rel).write_bytes(data)
        if fix is not None:
            _fix_table(root, rel, fix.manifest)

    return apply


def build_cases(p: Pristine) -> list[Case]:
    rng = random.Random(SEED)
    cases: list[Case] = []
    others = [f for f in p.files if f != "manifest.json"]

    # JSON-level mutations of manifest.json: no checksum guards it, so each one reaches the parser.
    for _ in range(420):
        what, data, hostile, _payload = _json_mutation(rng, p.manifest)
        cases.append(Case(f"manifest.json: {what}", _write("manifest.json", data), must_fail=hostile))
    # ... of rank.json, with the file table fixed up (mostly) or left as it was (checksum refuses first).
    for i in range(330):
        rel = rng.choice(sorted(p.records))
        what, data, hostile, _payload = _json_mutation(rng, p.records[rel])
        fixed = i % 10 != 0
        changed = data != (p.root / rel).read_bytes()
        cases.append(
            Case(
                f"{rel}: {what}" + ("" if fixed else " (table not fixed)"),
                _write(rel, data, p if fixed else None),
                must_fail=hostile or (not fixed and changed),
            )
        )
    # ... of payload JSON, table fixed: open_archive does not parse payloads; Archive.read_json does.
    for _ in range(100):
        rel = rng.choice(p.payload_json)
        doc = json.loads((p.root / rel).read_bytes())
        what, data, _hostile, payload = _json_mutation(rng, doc)
        cases.append(
            Case(
                f"{rel}: {what}",
                _write(rel, data, p),
                False,
                read_payloads=True,
                hostile_payload=rel if payload else None,
            )
        )
    # Byte flips (non-UTF-8 bytes, broken syntax), with and without a fixed-up table.
    for i in range(160):
        rel = rng.choice(p.files)
        data = bytearray((p.root / rel).read_bytes())
        for _ in range(rng.randint(1, 3)):
            pos = rng.randrange(len(data))
            data[pos] ^= rng.choice([0x01, 0x20, 0x80, 0xFF, rng.randrange(1, 256)])
        fixed = rel != "manifest.json" and i % 2 == 0
        cases.append(
            Case(
                f"flip bytes of {rel}" + (" (table fixed)" if fixed else ""),
                _write(rel, bytes(data), p if fixed else None),
                must_fail=rel != "manifest.json" and not fixed,
                read_payloads=fixed,
            )
        )
    # Truncations.
    for i in range(100):
        rel = rng.choice(p.files)
        full = (p.root / rel).read_bytes()
        cut = rng.choice([0, 1, rng.randrange(len(full)), len(full) - 1])
        fixed = rel != "manifest.json" and i % 2 == 0
        cases.append(
            Case(
                f"truncate {rel} to {cut} of {len(full)} bytes" + (" (table fixed)" if fixed else ""),
                _write(rel, full[:cut], p if fixed else None),
                must_fail=rel != "manifest.json" and not fixed,
                read_payloads=fixed,
            )
        )
    # Deletions of a file or a folder.
    folders = sorted({str(Path(f).parent) for f in others} - {"."})
    for _ in range(60):
        rel = rng.choice(p.files + folders)
        cases.append(Case(f"delete {rel}", _delete(rel), must_fail=True))
    # Additions: unlisted files, links, FIFOs, odd names; an empty folder is harmless.
    additions: list[tuple[str, Callable[[Path], None], bool]] = [
        ("extra top-level file", lambda r: (r / "extra.bin").write_bytes(b"x"), True),
        ("extra file in a rank", lambda r: (r / "rank_0" / "stray.json").write_text("{}"), True),
        ("extra rank folder", lambda r: _mkfile(r / "rank_7" / "rank.json", b"{}"), True),
        ("hidden file", lambda r: (r / ".hidden").write_bytes(b""), True),
        ("non-UTF-8 file name", lambda r: _mkfile(Path(os.fsdecode(os.fsencode(r) + b"/\xff\xfe.bin")), b"?"), True),
        ("FIFO", lambda r: os.mkfifo(r / "rank_1" / "pipe"), True),
        ("symlink to a listed file", lambda r: (r / "alias.json").symlink_to(r / "engine.json"), True),
        ("dangling symlink", lambda r: (r / "dangling").symlink_to(r / "nowhere"), True),
        ("symlink out of the archive", lambda r: (r / "rank_0" / "passwd").symlink_to("/etc/passwd"), True),
        ("folder loop", lambda r: (r / "rank_0" / "loop").symlink_to(r), True),
        ("empty folder", lambda r: (r / "rank_0" / "empty").mkdir(), False),
        ("deep empty folders", lambda r: (r / Path(*["d"] * 60)).mkdir(parents=True), False),
        ("deep file", lambda r: _mkfile(r / Path(*["d"] * 60) / "f", b""), True),
    ]
    # Replacements of listed files by things that are not regular files.
    replacements: list[tuple[str, Callable[[Path], None], bool]] = [
        ("manifest.json is a symlink to a copy", lambda r: _replace_by_link(r, "manifest.json"), True),
        ("manifest.json is a folder", lambda r: _replace_by_folder(r, "manifest.json"), True),
        ("manifest.json is a FIFO", lambda r: _replace(r, "manifest.json", os.mkfifo), True),
        ("rank.json is a symlink to a copy", lambda r: _replace_by_link(r, "rank_0/rank.json"), True),
        ("rank.json is a FIFO", lambda r: _replace(r, "rank_1/rank.json", os.mkfifo), True),
        ("payload is a folder", lambda r: _replace_by_folder(r, "engine.json"), True),
        ("rank folder is a symlink to a copy", lambda r: _replace_by_link(r, "rank_0"), True),
        ("graphs folder is a symlink to a copy", lambda r: _replace_by_link(r, "rank_1/graphs"), True),
        ("unreadable payload", lambda r: (r / "rank_0" / "allocations.log").chmod(0), False),  # root reads it
    ]
    for _ in range(3):
        for name, apply, must_fail in additions + replacements:
            cases.append(Case(name, apply, must_fail))
    cases.append(Case("huge manifest", lambda r: _mkfile(r / "manifest.json", b" " * (65 << 20)), must_fail=True))
    return cases


def _mkfile(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _delete(rel: str) -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        path = root / rel
        shutil.rmtree(path) if path.is_dir() else path.unlink()

    return apply


def _replace(root: Path, rel: str, make: Callable[[Path], None]) -> None:
    (root / rel).unlink()
    make(root / rel)


def _replace_by_link(root: Path, rel: str) -> None:
    """The same bytes, reached through a symbolic link to a copy outside the archive."""
    outside = root.parent / f"outside-{rel.replace('/', '_')}"
    shutil.rmtree(outside, ignore_errors=True)
    path = root / rel
    shutil.copytree(path, outside) if path.is_dir() else shutil.copy(path, outside)
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    path.symlink_to(outside)


def _replace_by_folder(root: Path, rel: str) -> None:
    (root / rel).unlink()
    (root / rel).mkdir()
    (root / rel / "inside").write_bytes(b"x")


# --- the test


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Pristine:
    root = write_archive(tmp_path_factory.mktemp("fuzz") / "pristine")
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    manifest = json.loads((root / "manifest.json").read_text())
    records = {f: json.loads((root / f).read_text()) for f in files if f.endswith("/rank.json")}
    payload_json = [f for f in files if f.endswith(".json") and f not in records and f != "manifest.json"]
    return Pristine(root, files, manifest, records, payload_json)


def _use_opened(archive: Any, case: Case) -> list[str]:
    """What the CLI and LOAD do with an opened archive; returns problems (never raises for a sound one)."""
    cli.describe(archive, list(archive.ranks))
    json.dumps(archive.manifest.to_dict(), ensure_ascii=False)
    for rank in archive.ranks:
        json.dumps(archive.rank_facts(rank).to_dict(), ensure_ascii=False)
        evaluate(archive, live_for(rank), rank)
    problems = []
    if case.read_payloads:
        for rel in archive.manifest.files:
            if rel.endswith("/rank.json"):
                continue
            try:
                if rel.endswith(".json"):
                    folder, _, name = rel.partition("/")
                    rank = int(folder.removeprefix("rank_")) if name and folder.startswith("rank_") else None
                    archive.read_json(rank, rel if rank is None else name)
                else:
                    archive.read_path(rel)
            except ArchiveError as exc:
                if not str(exc).strip():
                    problems.append(f"reading {rel}: ArchiveError with an empty message")
                continue
            if rel == case.hostile_payload:
                problems.append(f"payload {rel} was read although it holds a token JSON does not allow")
    return problems


def run_case(work: Path, pristine: Pristine, case: Case) -> tuple[str, str | None]:
    """('refused'|'opened', failure or None)."""
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(pristine.root, work, symlinks=True)
    case.apply(work)
    try:
        archive = open_archive(work)
    except ArchiveError as exc:
        if not str(exc).strip() or not exc.problems or not all(str(p).strip() for p in exc.problems):
            return "refused", "ArchiveError with an empty message or problem"
        return "refused", None
    except BaseException as exc:  # the bug this test hunts: anything but ArchiveError
        return "crashed", f"{type(exc).__name__}: {str(exc)[:200]}"
    if case.must_fail:
        return "opened", "opened although it must be refused"
    try:
        problems = _use_opened(archive, case)
    except BaseException as exc:
        return "opened", f"opened, then {type(exc).__name__}: {str(exc)[:200]}"
    return "opened", "; ".join(problems) or None


def _graphpersist(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO / "overlays" / "graphpersist"), PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run(
        [sys.executable, "-m", "graphpersist", *args], env=env, capture_output=True, text=True, cwd=REPO, timeout=120
    )


def test_hostile_archives_are_refused_cleanly(pristine: Pristine, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    cases = build_cases(pristine)
    assert len(cases) >= MIN_CASES
    # The CLI runs on the huge-integer and deep-nesting cases of both records, then on must-fail cases spread
    # over all kinds of mutation.
    named = [
        next(i for i, c in enumerate(cases) if c.must_fail and c.name.startswith(record) and c.name.endswith(token))
        for record in ("manifest.json: replace", "rank_0/rank.json: replace", "rank_1/rank.json: replace")
        for token in ("-> huge int", "-> deep list")
        if any(c.must_fail and c.name.startswith(record) and c.name.endswith(token) for c in cases)
    ]
    assert len(named) >= 4, "the huge-int and deep-nesting cases must be among those the CLI runs"
    must_fail = [i for i, c in enumerate(cases) if c.must_fail and i not in named]
    spread = must_fail[:: len(must_fail) // (CLI_CASES - len(named))][: CLI_CASES - len(named)]
    cli_picks = set(named) | set(spread)

    work = tmp_path / "archive"
    failures: list[str] = []
    outcomes = {"refused": 0, "opened": 0, "crashed": 0}
    cli_runs = 0
    for i, case in enumerate(cases):
        outcome, failure = run_case(work, pristine, case)
        outcomes[outcome] += 1
        if failure:
            failures.append(f"case {i} ({case.name}): {failure}")
        if i in cli_picks and outcome == "refused":
            command = (["check"], ["inspect"], ["inspect", "--json"])[cli_runs % 3]
            result = _graphpersist(*command, str(work))
            cli_runs += 1
            if result.returncode != 2 or "Traceback" in result.stderr or "cannot open archive" not in result.stderr:
                failures.append(f"case {i} ({case.name}): graphpersist {' '.join(command)} exited "
                                f"{result.returncode}: {result.stderr[-300:]}")  # fmt: skip
    with capsys.disabled():  # on the terminal even when pytest captures output, so the CI log shows the count
        print(f"\narchive fuzz: {len(cases)} cases (seed {SEED}): {outcomes}; CLI runs {cli_runs}")
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(failures[:40])
    assert cli_runs == len(cli_picks) == CLI_CASES
