"""Hostile archives, generated (seeded, reproducible) and run through everything that reads an archive on CPU.

Every case starts from an archive as SAVE writes it (archive_fixtures.write_loadable_archive: graph packs, allocation
log, phases, declared state, setup tensors, pointer inventory, images, shared files; two ranks) and changes it. The
families, and what each models:

* corrupted / truncated: bytes flipped or cut, the file table left as it was (damage), or regenerated to match
  (an edit followed by a tool that "repairs" checksums);
* sparse-huge: a file replaced by a sparse one of 16 GiB to 8 TiB, the table claiming that size, the old one, or
  4 EiB;
* type-confused, deeply nested, hostile JSON: manifest.json, rank.json and payload JSON mutated (wrong types, huge
  integers, NaN, deep nesting, duplicate, missing, renamed and extra keys), the table regenerated;
* re-hashed with changed payloads: any payload changed and the table regenerated to match;
* path-traversing: file-table keys, image, graph, pack and state file names that leave the archive or alias a name;
* escape-laden: terminal control sequences, newlines and bidi overrides in every kind of archive string;
* file-system oddities: deletions, unlisted files, links, FIFOs, non-UTF-8 names, deep folders;
* forged: a mutation whose file table *and* rank-record commitments were recomputed, as a forger would (the
  archive is not signed: see graphpersist.archive.digests). These reach the parsers behind the digests;
* forged records with regenerated digests (own block, forged_cases): digests stripped and the table regenerated
  (with and without a changed payload), forgeries that miss one digest, complete forgeries of compared facts (drift)
  and of values LOAD's CPU stage refuses (dtypes, attribute ids, description keys, allocation logs, phases);
* padding (own block, padding_cases): counts and sizes far past what an engine records (flags, pins, names, values,
  capture sizes, notes, node types, log events, functions), refused naming a cap or read in linear time;
* tar headers (own block, tar_header_cases; forged): the JIT-cache tar replaced by a hostile one
  (tests/cpu/hostile_tars.py: pax mtime nan, inf or 25 digits, malformed GNU sparse members, links, devices, '..',
  absolute paths, checksums, garbage, truncation, compression), by header fields rewritten with their checksum,
  header bytes flipped, or a real tar cut short;
* bombs (own block, bomb_cases; forged): a graph's kernel part replaced by a deflate bomb declaring up to 1.1 GB, or
  by a stream that inflates to more or less than it declares, or has bytes after its end;
* diff blind spots (own block, diff_blind_spot_cases; forged): a rank's graphs written again with one field LOAD
  reads changed (pack_forgery.resave): memset and memcpy fields and addresses (inside the inventory, outside it,
  outside the region), the function table's names, images and attributes, static tensor records, instantiate
  flags, events, edges, launch shapes.

Each case goes through what LOAD does on CPU, rank by rank, up to its first GPU call (open_archive(keep_rank=r), the
fact check against the live facts SAVE recorded, use_layout's read, loadstage.rank_stage, the shared files and the
JIT caches' rules, loadstage.shared_stage), through `graphpersist check` (loadstage with every_byte, then the CLI),
`inspect`, `inspect --json`, `diff` against the original, the engine's read_shared, and the JIT caches restored into
a host's cache folders (read_shared + jitcache.restore, what LOAD does first). What must hold, per case:

* `check` refuses (exit 2) iff some rank's LOAD CPU stage refuses (ArchiveError): both run loadstage. The one
  difference allowed, counted as "check only": check's every-byte read refusing what LOAD's fast path leaves to the
  file table (graph parts' and state payloads' own sha256, kernel nodes against their topology fingerprint), in
  forged cases only;

* no exception but ArchiveError (the CLI: exit 0-3 and no traceback); each case ends in under 2 s of CPU time (the
  test process's and its commands', os.times), and none blocks: 30 s of wall clock is a hang, however loaded CI is;
* no raw control character (ESC, CR, BEL, C1, bidi overrides) in any output or error message;
* zero accepted changes to what LOAD uses: wherever a rank's LOAD stage accepts the archive, the digest of what it
  took from it (every graph's description, parameter blob and kernel table, static tensor records, images, pointer
  inventory, setup tensors, torch blocks, phases, allocation log, declared state, engine notes, shared files) equals
  the original's; likewise for `check`'s every-byte read. Forged JSON cases are exempt from this one (a forger who
  recomputes every digest writes another archive; they must still be refused where a field's type is wrong, and
  never crash); forged binary cases are not (each graph's and image's own hashes still bind them);
* file-system oddities (links, FIFOs, unlisted or missing files), sparse-huge files and traversing paths are refused
  by every reader they reach (a rank's damaged file by that rank's LOAD and by `check`; the other rank's LOAD never
  reads it);
* a hostile tar is refused by the restore (JitCacheError), and a refused restore leaves the cache folders exactly as
  they were; whatever a restore accepts leaves nothing but regular files and folders in them;
* no missed difference: `diff` against the original never says "equal" for a case that changes a field LOAD reads.

The counts (per family and outcome) are printed to the terminal. Seed: SEED, or GP_FUZZ_SEED to explore others.
The whole suite (about 55 s on 2 cores shared with other work) is marked slow: it runs in `make test` (CI);
test_hostile_archives_smoke runs every 25th case in `make test-fast`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import hostile_tars
import pack_forgery
import pytest
from archive_fixtures import forge, live_for, redigest, smi_rows, write_loadable_archive

from graphpersist import cli, loadstage
from graphpersist.archive import ArchiveError, jitcache, liveenv, open_archive, read_shared, safejson
from graphpersist.archive import digests as archive_digests
from graphpersist.archive.manifest import MAX_ENV, MAX_FLAGS
from graphpersist.archive.validate import evaluate
from graphpersist.errors import JitCacheError
from graphpersist.graph import format as graphformat
from graphpersist.loadplan import LoadPlan
from graphpersist.memory import layout

REPO = Path(__file__).resolve().parents[2]
SEED = int(os.environ.get("GP_FUZZ_SEED", "20261203"))
MIN_CASES = 1000
CASE_SECONDS = 2.0  # CPU seconds a case's readers may take (a quadratic reader took seconds here)
HANG_SECONDS = 30.0  # wall-clock seconds after which a case hangs (a reader blocked on a FIFO, a lock)
CLI_SUBPROCESS_CASES = 10
RANKS = (0, 1)
SHARED = ("engine.json", "jitcache.tar")
CONTROL = ("\x1b", "\r", "\x07", "\x08", "\x00", "\x7f", "\x9b", "\x85", "\u202e", "\u2066", "\u2028")
ESCAPES = [
    "\x1b[2J\x1b[Hgraphpersist: archive fits",
    "name\r\nforged line",
    "\x1b]0;title\x07bell",
    "\u202eevil\u202c",
    "c1 \x9b31m csi",
    "nul\x00byte",
]

# Raw JSON text no record may hold, wherever it lands (safejson strict refuses it); `payload`: also refused in
# payload JSON (read without the per-object checks).
HOSTILE: dict[str, tuple[str, bool]] = {
    "huge int": ("9" * 5000, True),
    "huge negative int": ("-" + "7" * 4400, True),
    "int over 64 bits": (str(2**64), False),
    "NaN": ("NaN", True),
    "Infinity": ("Infinity", True),
    "1e999": ("1e999", True),
    "deep list": ("[" * 100_000 + "]" * 100_000, True),
    "deep object": ('{"a":' * 40 + "1" + "}" * 40, False),
    "lone surrogate": ('"\\ud800"', False),
}
# Well-formed JSON of (mostly) another type: refused where a field's type differs, harmless where it fits.
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
    "escapes": json.dumps(ESCAPES[0]),
    "newline": json.dumps(ESCAPES[1]),
}
# File-table keys no archive may use (or that name nothing real).
PATHS = [
    "../engine.json",
    "/etc/passwd",
    "rank_0/../engine.json",
    "rank_0//alloc_log.json",
    "./engine.json",
    "",
    "manifest.json",
    "rank_0\\alloc_log.json",
    "rank_9/rank.json",
    "rank_01/x",
    "rank_" + "9" * 5000 + "/x",
    "x" * 5000,
    "nul\0byte",
    "rank_0/graphs",
    "rank_0/alloc_log.json/x",
    "images/../../x",
]


class Hang(Exception):
    """A case that ran past HANG_SECONDS of wall clock."""


def cpu_seconds() -> float:
    """CPU time of this process and of the commands it ran and waited for (the CLI cases run `graphpersist`): what a
    case costs, unlike the wall clock, which a loaded 2-core CI machine stretches."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


EVERY_READER = frozenset({"open", "load 0", "load 1", "check 0", "check 1"})
RESTORE = frozenset({"restore"})  # the JIT caches put back (read_shared + jitcache.restore), what LOAD does first
BINDING = frozenset({"load", "check", "shared"})


def rank_readers(rank: int) -> frozenset[str]:
    """The readers of one rank's files: its LOAD and `check` of it (the other rank's LOAD never reads them)."""
    return frozenset({f"load {rank}", f"check {rank}"})


@dataclass(frozen=True)
class Case:
    family: str
    name: str
    apply: Callable[[Path], None]
    refuse: frozenset[str] = frozenset()  # readers that must refuse it ("open": inspect, check and diff)
    binding: frozenset[str] = BINDING  # readers for which "accepted" must mean "what they use is unchanged"
    differs: bool = False  # it changes what LOAD reads: `diff` against the original must not say "equal"


@dataclass
class Pristine:
    root: Path
    files: list[str]  # every file, relative, manifest.json included
    manifest: dict[str, Any]
    json_files: list[str]  # every JSON file but manifest.json
    binary_files: list[str]
    result: Result = field(init=False)

    def event(self, rank: int, i: int) -> list[Any]:
        """Row i of rank `rank`'s allocation log: [kind, address, size, requested size]."""
        return json.loads((self.root / f"rank_{rank}" / "alloc_log.json").read_bytes())[i]

    def region(self) -> tuple[int, int]:
        """(base, size) of rank 0's region (every rank's in the fixture)."""
        region = json.loads((self.root / "rank_0" / "rank.json").read_bytes())["region"]
        return region["base"], region["size"]


# ----------------------------------------------------------------------------------------------- the readers


def _digest(value: Any) -> str:
    def default(obj: Any) -> Any:
        if isinstance(obj, bytes | bytearray | memoryview):
            return hashlib.sha256(bytes(obj)).hexdigest()
        if dataclasses.is_dataclass(obj):
            return dataclasses.asdict(obj)
        if isinstance(obj, tuple | set | frozenset):
            return list(obj)
        raise TypeError(type(obj).__name__)

    return hashlib.sha256(json.dumps(value, sort_keys=True, default=default).encode()).hexdigest()


_DESC_KEYS = ("nodes", "edges", "edge_ends", "edge_data", "events", "funcs", "blob_size", "table_size")


def load_inputs(plan: LoadPlan, images: dict[str, bytes]) -> dict[str, Any]:
    """What a rank's LOAD takes from the archive (LoadPlan plus image bytes), as plain data to digest: every value a
    rebuild, a memory restore, a state check or the engine uses. Not: informational fields, hashes that only verify."""
    rec = plan.record
    return {
        "region": [rec.region.base, rec.region.size, rec.region.final_offset],
        "records": [
            [g.name, g.node_count, g.nodes_by_type, g.topology_fingerprint, g.instantiate_flags] for g in rec.graphs
        ],
        "images": [[im.sha256, im.kind, list(im.entries), images[im.file]] for im in rec.images],
        "graphs": {
            name: [{k: desc[k] for k in _DESC_KEYS if k in desc}, blob, table, entry.inputs, entry.outputs]
            for name, (desc, blob, table, entry) in plan.graphs.items()
        },
        "pointers": plan.pointers,
        "setup_tensors": plan.setup_tensors,
        "torch_blocks": plan.torch_blocks,
        "phases": [dataclasses.asdict(p) for p in plan.phases],
        "events": [e.key() for e in plan.events],
        "states": [dataclasses.asdict(s) for s in plan.states],
        "notes": plan.notes,
    }


@dataclass
class Result:
    """What every reader did with one archive."""

    load: dict[int, str] = field(default_factory=dict)  # rank -> "refused: ..." | "drift" | digest
    check: dict[int, str] = field(default_factory=dict)
    fast: dict[int, str] = field(default_factory=dict)  # check's rank stage without every_byte: what LOAD reads
    shared: dict[str, str] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)  # everything printed or raised, to scan for control characters
    crashes: list[str] = field(default_factory=list)
    cli_codes: list[int] = field(default_factory=list)
    codes: dict[str, int] = field(default_factory=dict)  # command -> its (last) exit code
    restore: str = ""  # "refused: ...", "absent" or a digest of the cache folders after it
    opened: bool = False
    first_refusal: str = ""

    def refused(self, where: str, exc: ArchiveError) -> str:
        text = str(exc)
        self.outputs.append(text)
        if not text.strip() or not exc.problems or not all(str(p).strip() for p in exc.problems):
            self.crashes.append(f"{where}: ArchiveError with an empty message or problem")
        self.first_refusal = self.first_refusal or f"{where}: {exc.problems[0] if exc.problems else text}"
        return f"refused: {where}"


def _guarded(result: Result, where: str, call: Callable[[], str]) -> str:
    try:
        return call()
    except ArchiveError as exc:
        return result.refused(where, exc)
    except Hang:
        raise
    except BaseException as exc:  # the bug this test hunts: anything but ArchiveError
        result.crashes.append(f"{where}: {type(exc).__name__}: {str(exc)[:300]}")
        return f"crashed: {where}"


def _cli(result: Result, *args: str) -> None:
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(list(args))
    except Hang:
        raise
    except BaseException as exc:
        result.crashes.append(f"graphpersist {args[0]}: {type(exc).__name__}: {str(exc)[:300]}")
        return
    result.cli_codes.append(code)
    result.codes[args[0]] = code
    result.outputs += [out.getvalue(), err.getvalue()]
    if code not in (0, 1, 2, 3) or "Traceback" in err.getvalue():
        result.crashes.append(f"graphpersist {args[0]} exited {code}: {err.getvalue()[-300:]}")
    if code == 2 and not err.getvalue().strip():
        result.crashes.append(f"graphpersist {args[0]} exited 2 without saying why")
    if args[0] == "inspect" and "--json" in args and code == 0:
        json.loads(out.getvalue())


def _shared(root: Path, name: str) -> str:
    data = read_shared(root, name)
    return "absent" if data is None else _digest(data)  # not listed: the engine carries no such file


def through_everything(root: Path, pristine_root: Path, *, all_commands: bool, every_command: bool = True) -> Result:
    """Runs one archive through every reader (see the module's docstring); records outcomes, never raises.

    The CLI: `check` always; `inspect` too when the archive opens; `inspect --json` and `diff` when it opens and
    `every_command`, or when `all_commands` (an archive refused at open is refused alike by every command)."""
    result = Result()

    for rank in RANKS:

        def load_stage(rank: int = rank) -> str:
            """A rank's LOAD up to its first GPU call, whatever the facts say (drift is told apart at the end)."""
            archive = open_archive(root, keep_rank=rank)
            drift = bool(evaluate(archive, live_for(rank), rank).mismatches)  # LOAD refuses naming each field
            layout.saved_phases(archive, rank)  # what use_layout() reads
            plan = loadstage.rank_stage(archive, rank)
            for name in SHARED:  # the engine's reads of the shared files, and the JIT caches' restore rules
                archive.read(None, name)
            loadstage.shared_stage(archive)
            images = {im.file: archive.read_path(im.file) for im in plan.record.images}
            return "drift" if drift else _digest(load_inputs(plan, images))

        result.load[rank] = _guarded(result, f"LOAD rank {rank}", load_stage)

    opened = _guarded(result, "open", lambda: "opened" if open_archive(root) else "")
    result.opened = opened == "opened"
    if result.opened:
        archive = open_archive(root)
        for rank in RANKS:

            def check_stage(rank: int = rank, every_byte: bool = True) -> str:
                plan = loadstage.rank_stage(archive, rank, every_byte=every_byte)
                images = {im.file: archive.read_path(im.file) for im in plan.record.images}
                return _digest(load_inputs(plan, images))

            result.check[rank] = _guarded(result, f"check rank {rank}", check_stage)
            result.fast[rank] = _guarded(result, f"check rank {rank} as LOAD reads", partial(check_stage, rank, False))
    for name in SHARED:
        result.shared[name] = _guarded(result, f"read_shared {name}", lambda name=name: _shared(root, name))
    result.restore = restore_caches(result, root)
    _cli(result, "check", str(root))
    if result.opened or all_commands:
        _cli(result, "inspect", str(root))
    if (result.opened and every_command) or all_commands:
        _cli(result, "inspect", "--json", str(root))
        _cli(result, "diff", str(pristine_root), str(root))
    return result


# ----------------------------------------------------------------------------------------------- mutations


def _paths(doc: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every path into a JSON tree (the root included), as tuples of keys and indices."""
    yield prefix
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc[:8]):  # long lists (pointers, edges): their first items stand for the rest
            yield from _paths(value, (*prefix, i))


def _get(doc: Any, path: tuple) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def _render(doc: Any, raw: dict[str, str]) -> bytes:
    """JSON text of `doc`, with each placeholder string replaced by its raw text (tokens json.dumps cannot write)."""
    text = json.dumps(doc, indent=2, ensure_ascii=False)
    for placeholder, token in raw.items():
        text = text.replace(f'"{placeholder}"', token)
    return text.encode("utf-8", "surrogatepass")


def json_mutation(rng: random.Random, doc: Any, *, hostile_share: float = 0.35) -> tuple[str, bytes, Any]:
    """One random mutation of `doc`: (description, new bytes, the new document when it is plain JSON else None)."""
    doc = copy.deepcopy(doc)
    path = rng.choice(list(_paths(doc)))
    target = _get(doc, path)
    raw: dict[str, str] = {}
    if rng.random() < hostile_share:
        label, (token, _payload) = rng.choice(sorted(HOSTILE.items()))
    else:
        label, token = rng.choice(sorted(BENIGN.items()))
    raw["@@FUZZ@@"] = token
    ops = ["replace"]
    if isinstance(target, dict):
        ops += ["add key", "duplicate key", "delete key", "rename key"] if target else ["add key"]
    if isinstance(target, list) and target:
        ops += ["delete item", "append"]
    op = rng.choice(ops)
    where = "/".join(str(p)[:40] for p in path) or "<root>"
    if op == "replace":
        if path:
            _get(doc, path[:-1])[path[-1]] = "@@FUZZ@@"
        else:
            doc = "@@FUZZ@@"
    elif op == "add key":
        target[rng.choice(["fuzz_extra", ESCAPES[rng.randrange(len(ESCAPES))]])] = "@@FUZZ@@"
    elif op == "append":
        target.append("@@FUZZ@@")
    elif op == "duplicate key":
        key = rng.choice(sorted(target))
        target["@@DUPKEY@@"] = "@@FUZZ@@"
        raw["@@DUPKEY@@"] = json.dumps(key, ensure_ascii=False)
    elif op == "delete key":
        key = rng.choice(sorted(target))
        del target[key]
        label, where = "-", f"{where}/{str(key)[:40]}"
    elif op == "delete item":
        del target[rng.randrange(len(target))]
        label = "-"
    else:  # rename key: to an unknown name, or (in the file table) to a path no archive may use
        key = rng.choice(sorted(target))
        new = rng.choice(PATHS) if path == ("files",) else rng.choice([f"{key}_renamed", key.upper(), ESCAPES[0]])
        target[new] = target.pop(key)
        label, where = repr(new[:40]), f"{where}/{str(key)[:40]}"
    data = _render(doc, raw)
    try:  # what a forger can write: JSON the strict reader takes (hostile tokens stay in the re-hashed family)
        plain = safejson.loads(data) if len(data) < 1 << 20 else None
    except safejson.JsonError:
        plain = None
    return f"{op} {where} -> {label}", data, plain


def _replace_file(path: Path, data: bytes) -> None:
    """A new file at `path` (never writing through the old inode: cases are hard-linked copies of the original)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    path.write_bytes(data)


def _retable(root: Path, rel: str) -> None:
    """The file table regenerated for `rel` (its sha256 and size), as a checksum-repairing tool would."""
    manifest = json.loads((root / "manifest.json").read_bytes())
    data = (root / rel).read_bytes()
    manifest["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    _replace_file(root / "manifest.json", json.dumps(manifest, indent=2).encode())


def _forge(root: Path, rel: str, data: bytes) -> None:
    """forge() on a hard-linked copy: the files it rewrites are replaced, never written through."""
    for name in {rel, "manifest.json", *(f"rank_{r}/rank.json" for r in RANKS)}:
        path = root / name
        if path.is_file():
            _replace_file(path, path.read_bytes())
    forge(root, rel, data)


def _write(rel: str, data: bytes, how: str) -> Callable[[Path], None]:
    """`how`: "as is" (damage), "table" (table regenerated), "forged" (table and record commitments regenerated)."""

    def apply(root: Path) -> None:
        if how == "forged":
            _forge(root, rel, data)
            return
        _replace_file(root / rel, data)
        if how == "table":
            _retable(root, rel)

    return apply


def _sparse(rel: str, size: int, claim: int | None) -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        path = root / rel
        path.unlink()
        with open(path, "wb") as fh:
            fh.truncate(size)
        if claim is not None:
            manifest = json.loads((root / "manifest.json").read_bytes())
            manifest["files"][rel]["size"] = claim
            _replace_file(root / "manifest.json", json.dumps(manifest, indent=2).encode())

    return apply


def _mkfile(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _delete(rel: str) -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        path = root / rel
        shutil.rmtree(path) if path.is_dir() else path.unlink()

    return apply


def _replace_by_link(root: Path, rel: str) -> None:
    """The same bytes, reached through a symbolic link to a copy outside the archive."""
    outside = root.parent / f"outside-{rel.replace('/', '_')}"
    shutil.rmtree(outside, ignore_errors=True)
    path = root / rel
    shutil.copytree(path, outside) if path.is_dir() else shutil.copy(path, outside)
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    path.symlink_to(outside)


def _replace_by(root: Path, rel: str, make: Callable[[Path], None]) -> None:
    (root / rel).unlink()
    make(root / rel)


def _folder_instead(path: Path) -> None:
    path.mkdir()
    (path / "inside").write_bytes(b"x")


def _edit_record_and_index(change: Callable[[dict[str, Any], dict[str, Any]], None]) -> Callable[[Path], None]:
    """A forger's change to rank 0's record and graph index together (e.g. a graph renamed in both)."""

    def apply(root: Path) -> None:
        index = json.loads((root / "rank_0/graphs/index.json").read_bytes())
        record = json.loads((root / "rank_0/rank.json").read_bytes())
        change(record, index)
        _forge(root, "rank_0/graphs/index.json", json.dumps(index, indent=2).encode())
        record = json.loads((root / "rank_0/rank.json").read_bytes())
        change(record, {"graphs": [], "funcs": []})
        _forge(root, "rank_0/rank.json", json.dumps(redigest(record), indent=2).encode())

    return apply


def _edit_manifest(change: Callable[[dict[str, Any]], None], *, forged: bool = False) -> Callable[[Path], None]:
    """manifest.json changed; `forged`: rank 0's commitment to it recomputed too (else only its file table, which
    no record commits to, may change unnoticed)."""

    def apply(root: Path) -> None:
        manifest = json.loads((root / "manifest.json").read_bytes())
        change(manifest)
        data = json.dumps(manifest, indent=2, ensure_ascii=False).encode()
        _forge(root, "manifest.json", data) if forged else _replace_file(root / "manifest.json", data)

    return apply


def _binding(rel: str, how: str) -> frozenset[str]:
    """Forged bytes bind `check` where the file has its own hashes inside the archive (a graph pack: each graph's
    part hashes in the index; an image: its sha256 in the record; a state payload: the state's sha256), nothing
    elsewhere; damaged or re-hashed bytes bind every reader."""
    if how != "forged":
        return BINDING
    inner = rel.endswith("graphs/pack.bin") or rel.startswith("images/") or "/state/" in rel
    return frozenset({"check"}) if inner else frozenset()


def build_cases(p: Pristine, seed: int = SEED) -> list[Case]:
    rng = random.Random(seed)
    cases: list[Case] = []
    records = [f for f in p.json_files if f.endswith("/rank.json")]
    payload_json = [f for f in p.json_files if f not in records]
    docs = {rel: json.loads((p.root / rel).read_bytes()) for rel in p.json_files}

    for _ in range(260):  # manifest.json: rank 0's record commits to it but for its file table (which names files)
        what, data, _ = json_mutation(rng, p.manifest)
        cases.append(Case("manifest JSON", f"manifest.json: {what}", _write("manifest.json", data, "as is")))
    for i in range(340):  # rank records: the table regenerated, or forged (record digest recomputed too)
        rel = rng.choice(records)
        what, data, plain = json_mutation(rng, docs[rel])
        if i % 2 and isinstance(plain, dict):
            forged = json.dumps(redigest(plain), indent=2).encode()
            cases.append(
                Case("record JSON, forged", f"{rel}: {what}", _write(rel, forged, "forged"), binding=frozenset())
            )
        else:
            cases.append(Case("record JSON, re-hashed", f"{rel}: {what}", _write(rel, data, "table")))
    for i in range(240):  # payload JSON (graph index, allocation log, setup tensors, pointers, engine.json)
        rel = rng.choice(payload_json)
        what, data, _ = json_mutation(rng, docs[rel], hostile_share=0.25)
        how = "forged" if i % 2 else "table"
        family = "payload JSON, forged" if how == "forged" else "payload JSON, re-hashed"
        cases.append(Case(family, f"{rel}: {what}", _write(rel, data, how),
                          binding=frozenset() if how == "forged" else BINDING))  # fmt: skip
    for i in range(150):  # corrupted: bytes flipped, the table as it was, regenerated, or forged (binary files)
        rel = rng.choice(p.files if i % 3 == 0 else p.binary_files)
        data = bytearray((p.root / rel).read_bytes())
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] ^= rng.choice([0x01, 0x20, 0x80, 0xFF, rng.randrange(1, 256)])
        how = "as is" if rel == "manifest.json" else ("as is", "table", "forged")[i % 3]
        how = "table" if how == "forged" and rel not in p.binary_files else how
        cases.append(Case("corrupted", f"flip bytes of {rel} ({how})", _write(rel, bytes(data), how),
                          binding=_binding(rel, how)))  # fmt: skip
    for i in range(80):  # truncated
        rel = rng.choice(p.files)
        full = (p.root / rel).read_bytes()
        cut = rng.choice([0, 1, rng.randrange(len(full)), len(full) - 1])
        how = "as is" if rel == "manifest.json" else ("as is", "table", "forged")[i % 3]
        how = "table" if how == "forged" and rel not in p.binary_files else how
        cases.append(Case("truncated", f"truncate {rel} to {cut} of {len(full)} bytes ({how})",
                          _write(rel, full[:cut], how), binding=_binding(rel, how)))  # fmt: skip
    for i in range(24):  # sparse-huge
        rel = rng.choice([f for f in p.files if f != "manifest.json"])
        size = rng.choice([16 << 30, 1 << 40, 8 << 40])  # ext4 stops at 16 TiB; the table may claim more
        claim = (None, size, rng.randrange(1, 1 << 20), 1 << 62)[i % 4]
        cases.append(Case("sparse-huge", f"{rel} sparse {size} bytes, table says {claim or 'as before'}",
                          _sparse(rel, size, claim), refuse=EVERY_READER))  # fmt: skip
    for i, path in enumerate(PATHS * 2):  # path-traversing file-table keys, and names in records and the index
        rel = rng.choice([f for f in p.files if f != "manifest.json"])
        if i < len(PATHS):
            entry = {"sha256": "0" * 64, "size": 1}
            change = _edit_manifest(lambda m, path=path, entry=entry: m["files"].__setitem__(path, entry))
            cases.append(Case("path-traversing", f"file table lists {path[:40]!r}", change, refuse=EVERY_READER))
        else:
            change = _edit_manifest(lambda m, rel=rel, path=path: m["files"].__setitem__(path, m["files"].pop(rel)))
            cases.append(
                Case("path-traversing", f"file table renames {rel} to {path[:40]!r}", change, refuse=EVERY_READER)
            )
    traversing = ["../../../etc/passwd", "/etc/passwd", "rank_0/../rank_1/graphs/pack.bin", "images/../manifest.json",
                  "a//b", "state/../../rank_1/state/0.bin"]  # fmt: skip
    for bad in traversing:  # names in rank 0's record and index (forged, so that they reach their readers)
        cases += [
            Case("path-traversing", f"image file {bad!r}", _edit_record_and_index(
                lambda r, i, bad=bad: r["images"][0].update(file=bad)), refuse=EVERY_READER, binding=frozenset()),
            Case("path-traversing", f"graph file {bad!r}", _edit_record_and_index(
                lambda r, i, bad=bad: r["graphs"][0].update(file=bad)), refuse=EVERY_READER, binding=frozenset()),
            Case("path-traversing", f"state file {bad!r}", _edit_record_and_index(
                lambda r, i, bad=bad: r["extra"]["state"][0].update(file=bad)), refuse=rank_readers(0),
                binding=frozenset()),
            Case("path-traversing", f"index names pack {bad!r}", _edit_record_and_index(
                lambda r, i, bad=bad: i.update(pack=bad) if "pack" in i else None), refuse=rank_readers(0),
                binding=frozenset()),
        ]  # fmt: skip
    for i, text in enumerate(ESCAPES * 4):  # escape-laden strings wherever the archive holds text
        where = i // len(ESCAPES)
        if where == 0:
            cases.append(Case("escape-laden", f"graph name {text!r}", _edit_record_and_index(
                lambda r, x, text=text: [g.update(name=text) for g in r["graphs"][:1] + x["graphs"][:1]]),
                binding=frozenset()))  # fmt: skip
        elif where == 1:
            cases.append(Case("escape-laden", f"kernel name {text!r}", _edit_record_and_index(
                lambda r, x, text=text: [f.__setitem__(1, text) for f in x["funcs"][:1]]),
                binding=frozenset()))  # fmt: skip
        elif where == 2:
            cases.append(Case("escape-laden", f"manifest strings {text!r}", _edit_manifest(
                lambda m, text=text: (m["created"].update(host=text), m["world"]["env"].update({text: text}),
                                      m["world"]["engine"].update(name=text)), forged=True),
                              binding=frozenset()))  # fmt: skip
        else:
            cases.append(Case("escape-laden", f"engine notes and device {text!r}", _edit_record_and_index(
                lambda r, x, text=text: (r["extra"]["engine_notes"].update({text: text}),
                                         r["device"].update(uuid=text))), binding=frozenset()))  # fmt: skip
    for depth in (33, 64, 500, 5000, 100_000):  # deeply nested: records, payloads, output structures
        nested = "[" * depth + "]" * depth
        tree: Any = {"kind": "value", "value": None}
        for _ in range(min(depth, 300)):  # json.dumps recurses: deeper ones go in as text above
            tree = {"kind": "list", "items": [tree]}
        cases += [
            Case("deeply nested", f"rank.json extra nested {depth}", _write(
                "rank_1/rank.json", (p.root / "rank_1/rank.json").read_bytes().replace(
                    b'"extra": {', b'"extra": {"deep": ' + nested.encode() + b", ", 1), "forged"), refuse=EVERY_READER,
                binding=frozenset()),
            Case("deeply nested", f"alloc_log.json nested {depth}", _write(
                "rank_1/alloc_log.json", f"[{nested}]".encode(), "forged"), refuse=rank_readers(1),
                binding=frozenset()),
            Case("deeply nested", f"graph outputs nested {min(depth, 300)}", _edit_record_and_index(
                lambda r, x, tree=tree: [g.update(outputs=tree) for g in x["graphs"][:1]]), binding=frozenset()),
        ]  # fmt: skip
    folders = sorted({str(Path(f).parent) for f in p.files} - {"."})
    for _ in range(40):  # deletions of a file or a folder
        rel = rng.choice(p.files + folders)
        cases.append(Case("file system", f"delete {rel}", _delete(rel), refuse=EVERY_READER))
    oddities: list[tuple[str, Callable[[Path], None], bool]] = [  # (name, change, refused by every reader)
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
        ("manifest.json is a symlink to a copy", lambda r: _replace_by_link(r, "manifest.json"), True),
        ("manifest.json is a folder", lambda r: _replace_by(r, "manifest.json", _folder_instead), True),
        ("manifest.json is a FIFO", lambda r: _replace_by(r, "manifest.json", os.mkfifo), True),
        ("rank.json is a symlink to a copy", lambda r: _replace_by_link(r, "rank_0/rank.json"), True),
        ("rank.json is a FIFO", lambda r: _replace_by(r, "rank_1/rank.json", os.mkfifo), True),
        ("pack is a FIFO", lambda r: _replace_by(r, "rank_0/graphs/pack.bin", os.mkfifo), True),
        ("payload is a folder", lambda r: _replace_by(r, "engine.json", _folder_instead), True),
        ("rank folder is a symlink to a copy", lambda r: _replace_by_link(r, "rank_0"), True),
        ("graphs folder is a symlink to a copy", lambda r: _replace_by_link(r, "rank_1/graphs"), True),
        ("huge manifest", lambda r: _replace_file(r / "manifest.json", b" " * (65 << 20)), True),
    ]
    for name, apply, refuse in oddities:
        cases.append(Case("file system", name, apply, refuse=EVERY_READER if refuse else frozenset()))
    cases += forged_cases(p)
    cases += padding_cases()
    cases += name_resolution_cases()  # its own block, below
    more = random.Random(seed + 41)  # the blocks below draw from their own generator: those above stay as they were
    cases += tar_header_cases(more) + bomb_cases(p, more) + diff_blind_spot_cases(p, more)
    return cases


# ------------------------------------------------- forged records with regenerated digests (issue 41 items 3-5)


def _strip_digests(rank: int, rel: str | None = None, change: Callable[[bytes], bytes] | None = None) -> Callable[
        [Path], None]:  # fmt: skip
    """Rank `rank`'s record without extra.digests, and (given) `rel` changed, the file table regenerated to match:
    what deleting the commitments and "repairing" the checksums writes."""

    def apply(root: Path) -> None:
        record_rel = f"rank_{rank}/rank.json"
        record = json.loads((root / record_rel).read_bytes())
        del record["extra"]["digests"]
        _replace_file(root / record_rel, json.dumps(record, indent=2).encode())
        _retable(root, record_rel)
        if rel is not None and change is not None:
            _replace_file(root / rel, change((root / rel).read_bytes()))
            _retable(root, rel)

    return apply


def _flip(data: bytes) -> bytes:
    return bytes([data[0] ^ 0xFF]) + data[1:] if data else b"x"


def _json_edit(change: Callable[[Any], None]) -> Callable[[bytes], bytes]:
    def edit(data: bytes) -> bytes:
        doc = json.loads(data)
        change(doc)
        return json.dumps(doc, indent=2).encode()

    return edit


def _forge_json(rel: str, change: Callable[[Any], None]) -> Callable[[Path], None]:
    """A forger's edit of one JSON file (or manifest.json): every digest above it recomputed."""

    def apply(root: Path) -> None:
        doc = json.loads((root / rel).read_bytes())
        change(doc)
        _forge(root, rel, json.dumps(redigest(doc) if rel.endswith("/rank.json") else doc, indent=2).encode())

    return apply


def _half_forged(rel: str) -> Callable[[Path], None]:
    """`rel` (rank 1's) changed and its commitment in rank 1's record updated, but not the record's own digest."""

    def apply(root: Path) -> None:
        _replace_file(root / rel, _flip((root / rel).read_bytes()))
        record = json.loads((root / "rank_1/rank.json").read_bytes())
        record["extra"]["digests"]["files"][rel] = hashlib.sha256((root / rel).read_bytes()).hexdigest()
        _replace_file(root / "rank_1/rank.json", json.dumps(record, indent=2).encode())
        _retable(root, rel)
        _retable(root, "rank_1/rank.json")

    return apply


def _with_rank_readers(rank: int) -> frozenset[str]:
    """Refused by `rank`'s LOAD and by whatever opens the whole archive (inspect, check, diff)."""
    return frozenset({"open", f"load {rank}"})


def forged_cases(p: Pristine) -> list[Case]:
    """Digests stripped (the table regenerated), forgeries that miss one digest, and complete forgeries of what LOAD
    uses but cannot use (refused by the CPU stage both LOAD and check run) or compares (drift)."""
    family = "forged, digests regenerated"
    cases = []
    for rank in RANKS:
        readers = EVERY_READER if rank == 0 else _with_rank_readers(rank)
        own = [f"rank_{rank}/graphs/pack.bin", f"rank_{rank}/state/0.bin", f"rank_{rank}/alloc_log.json",
               f"rank_{rank}/pointers.json", f"rank_{rank}/graphs/index.json"]  # fmt: skip
        cases.append(Case(family, f"rank {rank}'s digests stripped", _strip_digests(rank), refuse=readers))
        for rel in own + (list(SHARED) if rank == 0 else []):
            cases.append(Case(family, f"rank {rank}'s digests stripped, {rel} changed",
                              _strip_digests(rank, rel, _flip), refuse=readers))  # fmt: skip
    cases += [
        Case(family, "rank 1's digests stripped, an allocation moved", _strip_digests(1, "rank_1/alloc_log.json",
             _json_edit(lambda log: log[0].__setitem__(1, log[0][1] + 4096))), refuse=_with_rank_readers(1)),
        Case(family, "rank 1's state payload changed, its record's own digest not", _half_forged("rank_1/state/0.bin"),
             refuse=_with_rank_readers(1)),
        Case(family, "manifest flag changed, rank 0's record's own digest not", _half_manifest(), refuse=EVERY_READER),
        Case(family, "rank 1's record commits to manifest.json", _forge_json("rank_1/rank.json", lambda r: r["extra"][
             "digests"].update(manifest="ab" * 32)), refuse=_with_rank_readers(1), binding=frozenset()),
        Case(family, "rank 0's record without its manifest commitment", _forge_json("rank_0/rank.json", lambda r: r[
             "extra"]["digests"].pop("manifest")), refuse=EVERY_READER, binding=frozenset()),
        Case(family, "rank 1's record commits to rank 0's pack", _forge_json("rank_1/rank.json", lambda r: r["extra"][
             "digests"]["files"].update({"rank_0/graphs/pack.bin": "cd" * 32})), refuse=_with_rank_readers(1),
             binding=frozenset()),
    ]  # fmt: skip
    drift = {  # complete forgeries of compared facts: the archive opens, LOAD refuses the drift
        "tp_size": lambda m: m["world"]["parallel"].update(tp_size=1),
        "an env pin": lambda m: m["world"]["env"].update(NCCL_ALGO="Ring"),
        "a flag": lambda m: m["world"]["flags"].update(enforce_eager=True),
        "capture sizes": lambda m: m["world"]["capture"].update(sizes=[1, 2]),
        "the torch version": lambda m: m["world"]["torch"].update(version="0.0"),
    }
    for what, change in drift.items():
        cases.append(Case(family, f"manifest {what} forged", _forge_json("manifest.json", change), binding=frozenset()))
    cases.append(Case(family, "manifest ranks forged", _forge_json("manifest.json", lambda m: m.update(ranks=[0])),
                      refuse=EVERY_READER, binding=frozenset()))  # fmt: skip
    for where, (rel, change) in _unusable(p).items():  # values LOAD's CPU stage refuses, where only it can
        rank = int(rel.split("/", 1)[0].removeprefix("rank_"))
        cases.append(Case(family, where, _forge_json(rel, change), refuse=rank_readers(rank), binding=frozenset()))
    return cases


def _half_manifest() -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        manifest = json.loads((root / "manifest.json").read_bytes())
        manifest["world"]["flags"]["enforce_eager"] = True
        record = json.loads((root / "rank_0/rank.json").read_bytes())
        record["extra"]["digests"]["manifest"] = archive_digests.manifest_digest(manifest)
        _replace_file(root / "rank_0/rank.json", json.dumps(record, indent=2).encode())
        _replace_file(root / "manifest.json", json.dumps(manifest, indent=2).encode())
        _retable(root, "rank_0/rank.json")

    return apply


def _unusable(p: Pristine) -> dict[str, tuple[str, Callable[[Any], None]]]:
    """What issue 41's fuzzing found check passing and LOAD refusing or crashing on, forged: (file, change) by name."""
    mib = 1 << 20

    def spec(**fields: Any) -> Callable[[Any], None]:
        return lambda index: index["graphs"][1]["inputs"][0].update(fields)

    def event(i: int, row: list[Any]) -> Callable[[Any], None]:
        return lambda log: log.__setitem__(i, row)

    base, size = p.region()
    return {
        **{f"dtype {d!r}": ("rank_0/graphs/index.json", spec(dtype=d)) for d in ("complex", "float_power", "floatx")},
        "a tensor of 2**80 bytes": ("rank_0/graphs/index.json", spec(shape=[1 << 40, 1 << 40], stride=[1 << 40, 1])),
        "function attribute '²'": ("rank_1/graphs/index.json", lambda x: x["funcs"][1][2].update({"²": 1})),
        "function attribute 99": ("rank_1/graphs/index.json", lambda x: x["funcs"][0][2].update({"99": 1})),
        "an extra edges key": ("rank_1/graphs/index.json", lambda x: x["descs"][0].update(edges=[[0, 1, 0, 0, 0]])),
        "an event past the region": ("rank_1/alloc_log.json", lambda log: log.append(["alloc", base + size, mib, mib])),
        "an outside event": ("rank_0/alloc_log.json", lambda log: log.append(["outside", 4096, 4096, 4096])),
        "a capture-time reservation": ("rank_1/alloc_log.json", event(2, ["reserve", *p.event(1, 2)[1:]])),
        "a graph address in no memory": ("rank_0/alloc_log.json", event(2, ["alloc", base + 512 * mib, 8 * mib,
                                                                           8 * mib])),
        "an event kind '²'": ("rank_1/alloc_log.json", event(0, ["²", *p.event(1, 0)[1:]])),
        "two phases of one name": ("rank_1/rank.json", lambda r: r["extra"]["phases"][1].update(name="(setup)")),
        "phases out of order": ("rank_0/rank.json", lambda r: r["extra"]["phases"][1].update(start_event=0)),
        "a phase past the region": ("rank_1/rank.json", lambda r: r["extra"]["phases"][2].update(limit=2 * size)),
    }  # fmt: skip


# ----------------------------------------------------------------------------------- padding (issue 41 item 3)


def padding_cases() -> list[Case]:
    """Counts and sizes far past what an engine records, forged (every digest recomputed, so only a cap or a linear
    reader stands between them and a hang): refused at once naming the cap, or read in linear time. A few thousand of
    a kind, as each case runs every reader up to ten times within CASE_SECONDS (the quadratic readers took seconds at
    that size; test_check_agrees_with_load takes `check` alone to 100000 flags)."""
    family = "padding"

    def flags(m: dict[str, Any], n: int) -> None:
        m["world"]["flags"].update({f"pad{i}": i for i in range(n)})

    over = {
        f"{MAX_FLAGS + 1} flags": lambda m: flags(m, MAX_FLAGS + 1),
        "5000 flags": lambda m: flags(m, 5_000),
        "5000 nested flags": lambda m: m["world"]["flags"].update(nested={f"f{i}": {"x": i} for i in range(5_000)}),
        f"{MAX_ENV + 1} env pins": lambda m: m["world"]["env"].update({f"PIN{i}": "1" for i in range(MAX_ENV + 1)}),
        "a flag name of 100000 characters": lambda m: m["world"]["flags"].update({"f" * 100_000: 1}),
        "a flag of 1 MiB": lambda m: m["world"]["flags"].update(big="v" * (1 << 20)),
        "20000 capture sizes": lambda m: m["world"]["capture"].update(sizes=list(range(20_000))),
        "an engine version of 100000 characters": lambda m: m["world"]["engine"].update(version="9" * 100_000),
    }
    cases = [Case(family, f"manifest with {what}", _forge_json("manifest.json", change), refuse=EVERY_READER,
                  binding=frozenset()) for what, change in over.items()]  # fmt: skip
    cases.append(Case(family, "5000 flags, not even forged", _edit_manifest(lambda m: flags(m, 5_000)),
                      refuse=EVERY_READER))  # fmt: skip
    cases.append(Case(family, f"{MAX_FLAGS - 1} flags more (under the cap)", _forge_json(
        "manifest.json", lambda m: flags(m, MAX_FLAGS - 1)), binding=frozenset()))  # fmt: skip
    cases += [
        Case(family, "5000 engine notes", _forge_json("rank_1/rank.json", lambda r: r["extra"]["engine_notes"].update(
             {f"n{i}": i for i in range(5_000)})), binding=frozenset()),
        Case(family, "5000 node types", _forge_json("rank_0/rank.json", lambda r: r["graphs"][0][
             "nodes_by_type"].update({f"t{i}": 1 for i in range(5_000)})), refuse=rank_readers(0),
             binding=frozenset()),
        Case(family, "5000 library maps, then 5000 unmaps, in a post-capture phase", _pad_post_capture(5_000),
             binding=frozenset()),
        Case(family, "5000 events after the last phase", _forge_json("rank_1/alloc_log.json", lambda log: log.extend(
             [log[0]] * 5_000)), refuse=rank_readers(1), binding=frozenset()),
        Case(family, "5000 unused functions", _forge_json("rank_0/graphs/index.json", lambda x: x["funcs"].extend(
             [x["funcs"][0]] * 5_000)), binding=frozenset()),
    ]  # fmt: skip
    return cases


def _pad_post_capture(n: int) -> Callable[[Path], None]:
    """n library maps at n addresses, then n unmaps of nothing, inside rank 1's post-capture phase (its log and phases
    forged): live_ranges once looked at every live mapping for each unmap (n squared, for each of its readers)."""

    def apply(root: Path) -> None:
        log = json.loads((root / "rank_1/alloc_log.json").read_bytes())
        addr = log[3][1]
        log[4:4] = [["lib_map", addr + 4096 * i, 4096, 0] for i in range(n)] + [["lib_unmap", addr, 0, 0]] * n
        _forge(root, "rank_1/alloc_log.json", json.dumps(log).encode())
        record = json.loads((root / "rank_1/rank.json").read_bytes())
        record["extra"]["phases"][2]["end_event"] += 2 * n
        _forge(root, "rank_1/rank.json", json.dumps(redigest(record), indent=2).encode())

    return apply


# ----------------------------------------------------------------------------------------------- tar headers
# The JIT-cache tar LOAD puts back first (jitcache.restore), forged into the archive so that read_shared hands it
# over. The catalogue's hostile tars and header bytes flipped must be refused; header fields rewritten with their
# checksum may be accepted or refused, and the restore reader holds both to its rules (see restore_caches).

_TAR_FIELDS = {"name": (0, 100), "mode": (100, 8), "uid": (108, 8), "size": (124, 12), "mtime": (136, 12),
               "type": (156, 1), "linkname": (157, 100), "magic": (257, 8), "uname": (265, 32),
               "devmajor": (329, 8), "prefix": (345, 155)}  # fmt: skip
_TAR_VALUES = [b"nan", b"inf", b"1" * 25, b"\xff" * 12, b"\x80" + bytes(11), b"../../etc/x", b"/etc/passwd", b"2",
               b"S", b"5", b"7", b"x", b"g", b"77777777777", b"-1", b"", b"ustar  ", b"triton/../x", b"0000644 ",
               b"00000000001"]  # fmt: skip


def _jit_tar() -> bytes:
    """A JIT-cache tar as collect writes it, of two cache folders (fixed bytes and times: the same on every run)."""
    with tempfile.TemporaryDirectory() as tmp:
        files = {"triton/AB12/kernel.cubin": b"\x7fELF cubin", "triton/AB12/kernel.json": b'{"num_warps": 4}',
                 "flashinfer/0.6/90a/sampling/sampling.so": b"\x7fELF so", "flashinfer/0.6/90a/sampling/" +
                 "long-name-" * 12: b"past the header's 100 bytes: a pax path"}  # fmt: skip
        for rel, data in files.items():
            path = Path(tmp, rel)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            os.utime(path, ns=(1_700_000_000_123_456_789, 1_700_000_000_123_456_789))
        return jitcache.collect({name: Path(tmp, name) for name in ("triton", "flashinfer")})[0]


def _tar_headers(blob: bytes) -> list[int]:
    """The offset of every header block (pax headers included) of a well-formed tar."""
    found, pos = [], 0
    while blob[pos : pos + 512].strip(b"\0"):
        found.append(pos)
        pos += 512 + -(-int(blob[pos + 124 : pos + 135], 8) // 512) * 512
    return found


def _rechecksum(block: bytearray, pos: int) -> None:
    block[pos + 148 : pos + 156] = b" " * 8
    block[pos + 148 : pos + 156] = b"%06o\0 " % sum(block[pos : pos + 512])


def tar_header_cases(rng: random.Random) -> list[Case]:
    good = _jit_tar()
    headers = _tar_headers(good)
    end = headers[-1] + 512 + -(-int(good[headers[-1] + 124 : headers[-1] + 135], 8) // 512) * 512

    def case(name: str, blob: bytes, refuse: frozenset[str] = RESTORE) -> Case:
        return Case("tar headers", name, _write(jitcache.SHARED_NAME, blob, "forged"), refuse=refuse,
                    binding=frozenset())  # fmt: skip

    cases = [case(label, blob) for label, (blob, _problem) in sorted(hostile_tars.HOSTILE.items())]
    cases.append(case("a tar as SAVE writes it", good, frozenset()))
    for _ in range(60):  # a field rewritten, its checksum recomputed: a forger's header
        pos, (what, (off, n)) = rng.choice(headers), rng.choice(sorted(_TAR_FIELDS.items()))
        value = rng.choice(_TAR_VALUES)
        blob = bytearray(good)
        blob[pos + off : pos + off + n] = value[:n].ljust(n, b"\0")
        _rechecksum(blob, pos)
        cases.append(case(f"header at byte {pos}: {what} = {value[:20]!r}", bytes(blob), frozenset()))
    for _ in range(30):  # a header byte flipped (the checksum field aside): the checksum no longer adds up
        pos = rng.choice(headers) + rng.choice([*range(148), *range(156, 512)])
        blob = bytearray(good)
        blob[pos] ^= rng.randrange(1, 256)
        cases.append(case(f"header byte {pos} flipped", bytes(blob)))
    for cut in sorted(rng.sample(range(end + 1024), 10)):  # cut before its end-of-archive blocks are whole
        cases.append(case(f"cut to {cut} of {len(good)} bytes", good[:cut]))
    return cases


# ----------------------------------------------------------------------------------------------- bombs
# A graph's kernel part (zlib JSON of its kernel nodes, inflated by `check`, diff and verify_topology) replaced. What
# declares more than the graph's kernel table can describe is refused before anything inflates, by LOAD too; what
# inflates to other than it declares is refused by `check` (LOAD never inflates it, and takes nothing from it).


def bomb_cases(p: Pristine, rng: random.Random) -> list[Case]:
    bomb = pack_forgery.deflate_bomb(1050)  # the case: 1 MiB declaring 1.1 GB, inside the 1100x cap
    cases = []
    for rank in RANKS:
        for i, graph in enumerate(pack_forgery.read_graphs(p.root, rank)):
            nodes = [nd for nd in graph.desc["nodes"] if nd["type"] == "kernel"]
            text = json.dumps(nodes, sort_keys=True, separators=(",", ":")).encode()
            mib = rng.choice([1, 4, 16, 64])
            variants = [
                ("a 1 MiB bomb declaring 1.1 GB", bomb, 1050 * pack_forgery.MIB, rank_readers(rank)),
                (f"a {mib} MiB bomb declaring what it inflates to", pack_forgery.deflate_bomb(mib),
                 mib * pack_forgery.MIB, rank_readers(rank)),
                ("its nodes and 1 MiB more, declaring the nodes", zlib.compress(text + b" " * pack_forgery.MIB),
                 len(text), frozenset({f"check {rank}"})),
                ("its nodes, declaring 100 bytes more", zlib.compress(text), len(text) + 100,
                 frozenset({f"check {rank}"})),
                ("garbage for a stream", bytes(rng.randrange(256) for _ in range(64)), len(text),
                 frozenset({f"check {rank}"})),
                ("its nodes and bytes after the stream", zlib.compress(text) + b"\0\0", len(text),
                 frozenset({f"check {rank}"})),
            ]  # fmt: skip
            for what, part, size, refuse in variants:
                apply = lambda root, r=rank, g=i, part=part, size=size: pack_forgery.replace_kernel_part(  # noqa: E731
                    root, r, g, part, size, forge=_forge
                )
                cases.append(Case("bombs", f"rank {rank} {graph.record['name']}: {what}", apply, refuse=refuse,
                                  binding=frozenset({"load"})))  # fmt: skip
    return cases


# ----------------------------------------------------------------------------------------------- diff blind spots
# A rank's graphs written again with one field LOAD reads changed (every hash and digest recomputed, as a forger or a
# second SAVE that differs would): `diff` against the original must name a difference whatever `check` says of it.
# Memset and memcpy addresses outside the region or the pointer inventory must be refused by that rank's readers.


def _first(kind: str) -> Callable[[pack_forgery.Graph], dict[str, Any]]:
    return lambda g: next(nd for nd in g.desc["nodes"] if nd["type"] == kind)


def _set(where: Callable[[pack_forgery.Graph], Any], key: Any, value: Any) -> Callable[[pack_forgery.Graph], None]:
    return lambda g: where(g).__setitem__(key, value(where(g)[key]) if callable(value) else value)


def diff_blind_spot_cases(p: Pristine, rng: random.Random) -> list[Case]:
    pointers = sorted(json.loads((p.root / "rank_0/pointers.json").read_bytes()))
    other = pointers[len(pointers) // 2]  # an address of the inventory (both ranks have it)
    region = json.loads((p.root / "rank_0/rank.json").read_bytes())["region"]  # both ranks': the fixture's
    outside, unlisted = region["base"] - 4096, region["base"] + 8200
    memcpy, memset, kernel = _first("memcpy"), _first("memset"), _first("kernel")
    edits: list[tuple[str, Callable[[pack_forgery.Graph], None], bool]] = []  # (what, change, refused by the rank)
    for key in graphformat.MEMCPY_FIELDS:
        device = key.endswith("Device")
        edits.append((f"memcpy {key}", _set(memcpy, key, other if device else (lambda v: v + 1)), False))
    edits += [("memcpy srcDevice outside the region", _set(memcpy, "srcDevice", outside), True),
              ("memcpy dstDevice not in the inventory", _set(memcpy, "dstDevice", unlisted), True),
              ("memcpy srcMemoryType unified", _set(memcpy, "srcMemoryType", 4), False),
              ("memcpy dstMemoryType host", _set(memcpy, "dstMemoryType", 1), True)]  # fmt: skip
    for key in ("pitch", "value", "elementSize", "width", "height"):
        edits.append((f"memset {key}", _set(memset, key, lambda v: v + 1), False))
    edits += [("memset dst", _set(memset, "dst", other), False),
              ("memset dst outside the region", _set(memset, "dst", outside), True),
              ("memset dst not in the inventory", _set(memset, "dst", unlisted), True),
              ("function name", lambda g: g.desc["funcs"][0].__setitem__(1, "k_renamed"), False),
              ("function image", lambda g: g.desc["funcs"][0].__setitem__(0, g.desc["funcs"][1][0]), False),
              ("function attribute changed", lambda g: g.desc["funcs"][1][2].update({"8": 1024}), False),
              ("function attribute added", lambda g: g.desc["funcs"][0][2].update({"9": 1}), False),
              ("function attribute dropped", lambda g: g.desc["funcs"][1][2].clear(), False),
              ("input tensor address", lambda g: g.inputs[0].update(addr=g.inputs[0]["addr"] + 64), False),
              ("input tensor outside the region", lambda g: g.inputs[0].update(addr=outside), True),
              ("input tensor dtype", lambda g: g.inputs[0].update(dtype="float16"), False),
              ("input tensor shape", lambda g: g.inputs[0]["shape"].__setitem__(0, 4), False),
              ("input tensor stride", lambda g: g.inputs[0]["stride"].__setitem__(0, 128), False),
              ("an input tensor more", lambda g: g.inputs.append(dict(g.inputs[0])), False),
              ("output tensor address", lambda g: g.outputs["items"][0]["spec"].update(addr=other), False),
              ("output tensor dtype", lambda g: g.outputs["items"][0]["spec"].update(dtype="float32"), False),
              ("output value", lambda g: g.outputs["items"][1].update(value=7), False),
              ("output tuple made a list", lambda g: g.outputs.update(kind="list"), False),
              ("instantiate flags", lambda g: g.record.update(instantiate_flags=9), False),
              ("instantiate flags LOAD cannot repeat", lambda g: g.record.update(instantiate_flags=2), True),
              ("capture size", lambda g: g.record.update(capture_size=(g.record["capture_size"] or 0) + 1), False),
              ("mode", lambda g: g.record.update(mode="piecewise"), False),
              ("edge data", lambda g: g.desc["edges"][0].__setitem__(4, 1), False),
              ("an edge dropped", lambda g: g.desc["edges"].pop(), False),
              ("kernel grid", _set(kernel, "grid", lambda v: [v[0] + 1, *v[1:]]), False),
              ("kernel shared memory", _set(kernel, "smem", 1024), False),
              ("kernel launch attribute", _set(kernel, "attrs", {"1": "02"}), False),
              ("a parameter word", lambda g: setattr(g, "blob", b"\1" + g.blob[1:]), False)]  # fmt: skip
    cases = []
    for what, change, refused in edits:
        rank = rng.choice(RANKS)
        name = "full-bs8" if "memset" in what else rng.choice([f"full-bs{b}" for b in (1, 2, 4, 8)])

        def apply(root: Path, rank: int = rank, name: str = name, change: Any = change) -> None:
            def edit(graphs: list[pack_forgery.Graph]) -> None:
                change(next(g for g in graphs if g.record["name"] == name))

            pack_forgery.resave(root, rank, edit, forge=_forge)

        refuse = rank_readers(rank) if refused else frozenset()
        cases.append(Case("diff blind spots", f"rank {rank} {name}: {what}", apply, refuse=refuse,
                          binding=frozenset(), differs=True))  # fmt: skip
    return cases


# ----------------------------------------------------------------------------------------------- the test


def _tree(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every entry below root, links not followed (a loop, not recursion): relative path -> what it is and holds."""
    out: dict[str, tuple[Any, ...]] = {}
    pending = [root]
    while pending:
        for entry in os.scandir(pending.pop()):
            info = entry.stat(follow_symlinks=False)
            rel = os.path.relpath(entry.path, root)
            if entry.is_dir(follow_symlinks=False):
                out[rel] = ("folder",)
                pending.append(Path(entry.path))
            elif entry.is_file(follow_symlinks=False):
                data = Path(entry.path).read_bytes()
                out[rel] = ("file", hashlib.sha256(data).hexdigest(), info.st_mode & 0o7777, info.st_mtime_ns)
            else:
                out[rel] = ("other", info.st_mode)
    return out


def restore_caches(result: Result, root: Path) -> str:
    """LOAD's first step (cachefolders.restore): the archive's JIT caches put back into a host's cache folders, one
    of which holds a file of its own. A refused restore must leave them as they were, and nothing but regular files
    and folders may ever appear in them."""
    box = root.parent / f"{root.name}-caches"
    shutil.rmtree(box, ignore_errors=True)
    (box / "triton").mkdir(parents=True)
    (box / "triton" / "own.bin").write_bytes(b"this host's own")
    os.utime(box / "triton" / "own.bin", ns=(10**18, 10**18))  # the same in every case: the digest compares it
    before = _tree(box)
    try:
        blob = read_shared(root, jitcache.SHARED_NAME)
        if blob is None:
            return "absent"
        jitcache.restore(blob, {"triton": box / "triton", "flashinfer": box / "fresh" / "flashinfer"})
    except (ArchiveError, JitCacheError) as exc:
        result.outputs.append(str(exc))
        result.first_refusal = result.first_refusal or f"restore: {str(exc)[:200]}"
        if _tree(box) != before:
            result.crashes.append("a refused restore changed the cache folders")
        return "refused: restore"
    except Hang:
        raise
    except BaseException as exc:  # the bug this test hunts
        result.crashes.append(f"restore: {type(exc).__name__}: {str(exc)[:300]}")
        return "crashed: restore"
    try:
        after = _tree(box)
    except OSError as exc:  # a path too long to walk
        result.crashes.append(f"a restore made what cannot be walked: {str(exc)[:200]}")
        return "crashed: restore"
    odd = [rel for rel, what in after.items() if what[0] == "other"]
    if odd:
        result.crashes.append(f"a restore made entries that are neither files nor folders: {odd[:3]}")
    return _digest(after)


def _on_alarm(signum: int, frame: Any) -> None:
    raise Hang()


def _binds(case: Case, what: str) -> bool:
    """Whether `case` must leave what `what` ("rank r's LOAD", "check of rank r", "read_shared of n") uses unchanged."""
    kind = {"rank": "load", "check": "check", "read_shared": "shared"}[what.split()[0]]
    return kind in case.binding


def agreement(case: Case, got: Result) -> tuple[list[str], bool]:
    """(failures, check_only): `check` refuses (exit 2) exactly when some rank's LOAD CPU stage refuses (ArchiveError),
    both running loadstage. The one difference allowed, `check_only`: check's every-byte read refusing what LOAD's
    fast path leaves to the file table (each graph part's and state payload's own sha256, the kernel nodes against
    their topology fingerprint), which only a forger who recomputed the digests above them gets past the table."""
    check_refused = got.codes.get("check") == 2
    load_refused = any(got.load[r].startswith("refused") for r in RANKS)
    check_only = (
        check_refused
        and not load_refused
        and got.opened
        and all(not got.fast[r].startswith(("refused", "crashed")) for r in RANKS)
        and any(got.check[r].startswith("refused") for r in RANKS)
    )
    failures = []
    if check_refused != load_refused and not check_only:
        who = "check refused it, every rank's LOAD CPU stage accepted it" if check_refused else (
            "a rank's LOAD CPU stage refused it, check did not")  # fmt: skip
        failures.append(f"check and LOAD disagree: {who} ({got.first_refusal[:200]})")
    if check_only and case.binding == BINDING:
        failures.append("check's every-byte read refused what LOAD's fast path accepts in a case no forger made")
    return failures, check_only


def run_case(case: Case, pristine: Pristine, work: Path, i: int) -> tuple[str, list[str], float, bool]:
    """(outcome, failures, seconds, refused by check's every-byte read only) of case number `i`."""
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(pristine.root, work, symlinks=True, copy_function=os.link)
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, HANG_SECONDS)
    start = cpu_seconds()
    try:
        case.apply(work)
        start = cpu_seconds()  # the readers' time: forging a 5000-deep record (json.dumps with indent) took 2.3 s
        got = through_everything(work, pristine.root, all_commands=i % 11 == 0,
                                 every_command=i % 3 == 0 or case.differs)  # fmt: skip
    except Hang:
        return "hung", [f"ran past {HANG_SECONDS} s of wall clock"], cpu_seconds() - start, False
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    seconds = cpu_seconds() - start
    want = pristine.result
    failures = list(got.crashes)
    if seconds >= CASE_SECONDS:
        failures.append(f"took {seconds:.2f} s of CPU (a case may take {CASE_SECONDS} s)")
    for text in got.outputs:
        raw = [c for c in CONTROL if c in text]
        if raw:
            failures.append(f"raw control characters {raw!r} in: {text[:200]!r}")
    accepted = [r for r in RANKS if not got.load[r].startswith(("refused", "crashed", "drift"))]
    checked = [r for r in RANKS if r in got.check and not got.check[r].startswith(("refused", "crashed"))]
    shared = [n for n in SHARED if not got.shared[n].startswith(("refused", "crashed", "absent"))]
    changed = [f"rank {r}'s LOAD" for r in accepted if got.load[r] != want.load[r]]
    changed += [f"check of rank {r}" for r in checked if got.check[r] != want.check[r]]
    changed += [f"read_shared of {n}" for n in shared if got.shared[n] != want.shared[n]]
    restored = not got.restore.startswith(("refused", "crashed"))
    if restored and got.restore != want.restore:
        changed.append("read_shared of the JIT caches, restored")
    for what in changed:
        if _binds(case, what):
            failures.append(f"{what} accepted a change to what it uses")
    took = {f"load {r}" for r in accepted} | {f"check {r}" for r in checked}
    took |= {"open"} if got.opened or 0 in got.cli_codes else set()
    took |= RESTORE if restored else set()
    if case.refuse & took:
        failures.append(f"accepted by {', '.join(sorted(case.refuse & took))} although it must be refused there")
    if case.differs and got.codes.get("diff") == 0:
        failures.append("diff says the archives are equal although this changes what LOAD reads")
    disagree, check_only = agreement(case, got)
    failures += disagree
    # The table shows what LOAD did, for the rank it did worst for (a rank whose own files are untouched accepts
    # them; check's acceptances are held to the same rule above): a change accepted (forged cases only), refused
    # (ArchiveError), refused as drift (LoadRefused), or accepted unchanged.
    if any(w.startswith("rank") for w in changed):
        outcome = "accepted, changed"
    elif any(got.load[r].startswith(("refused", "crashed")) for r in RANKS) or not restored:
        outcome = "refused"
    elif any(got.load[r] == "drift" for r in RANKS):
        outcome = "drift refused"
    else:
        outcome = "accepted, unchanged"
    return outcome, failures, seconds, check_only


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Where the cases live: tmpfs when there is one (thousands of folders made and removed), else tmp_path."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        folder = Path(tempfile.mkdtemp(prefix="gp-fuzz-", dir=shm))
        yield folder
        shutil.rmtree(folder, ignore_errors=True)
    else:
        yield tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def pristine(scratch: Path) -> Pristine:
    root = write_loadable_archive(scratch / "pristine")
    for path in root.rglob("*"):  # the cases are hard-linked copies: a write through one would show here
        if path.is_file():
            path.chmod(0o444)
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    manifest = json.loads((root / "manifest.json").read_text())
    json_files = [f for f in files if f.endswith(".json") and f != "manifest.json"]
    binary = [f for f in files if not f.endswith(".json")]
    p = Pristine(root, files, manifest, json_files, binary)
    p.result = through_everything(root, root, all_commands=True)
    assert not p.result.crashes and all(len(v) == 64 for v in (*p.result.load.values(), *p.result.check.values()))
    return p


@pytest.fixture(autouse=True)
def host_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """`check` collects live facts: the fixture's two GPUs, without running nvidia-smi for every case."""
    monkeypatch.setattr(liveenv, "_smi_gpus", lambda: smi_rows(2))


def _run(cases: list[Case], pristine: Pristine, work: Path, record: Callable[[str, object], None], label: str) -> None:
    started = time.perf_counter()
    failures: list[str] = []
    table: Counter[tuple[str, str]] = Counter()
    slowest = (0.0, "")
    for i, case in enumerate(cases):
        outcome, problems, seconds, check_only = run_case(case, pristine, work, i)
        table[(case.family, outcome)] += 1
        table[(case.family, "check only")] += check_only
        slowest = max(slowest, (seconds, case.name))
        failures += [f"case {i} [{case.family}] {case.name[:120]!r}: {p}" for p in problems]
    wall = time.perf_counter() - started
    families = sorted({f for f, _ in table})
    # "check only": refused by check's every-byte read alone (counted within the LOAD outcome beside it)
    outcomes = ["refused", "drift refused", "accepted, unchanged", "accepted, changed", "hung", "check only"]
    lines = [f"\narchive fuzz ({label}): {len(cases)} cases, seed {SEED}, {wall:.1f} s, slowest {slowest[0]:.2f} s CPU "
             f"({slowest[1][:60]!r}); failures {len(failures)}",
             f"  {'family':<34}" + "".join(f"{o:>21}" for o in outcomes)]  # fmt: skip
    for family in families:
        lines.append(f"  {family:<34}" + "".join(f"{table[(family, o)]:>21}" for o in outcomes))
    record("summary", "\n".join(lines))  # the terminal summary prints it, from any xdist worker: the CI log shows it
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])
    assert slowest[0] < CASE_SECONDS, f"the slowest case took {slowest[0]:.2f} s of CPU: {slowest[1]!r}"


@pytest.mark.slow
def test_hostile_archives_are_refused_or_harmless(
    pristine: Pristine, scratch: Path, record_property: Callable[[str, object], None]
) -> None:
    cases = build_cases(pristine)
    assert len(cases) >= MIN_CASES
    _run(cases, pristine, scratch / "case", record_property, "full")
    # The original is untouched by every case (they are hard-linked copies), and still reads the same.
    assert through_everything(pristine.root, pristine.root, all_commands=False).load == pristine.result.load


def test_hostile_archives_smoke(
    pristine: Pristine, scratch: Path, record_property: Callable[[str, object], None]
) -> None:
    """Every 25th case of the full suite, for `make test-fast`."""
    _run(build_cases(pristine)[::25], pristine, scratch / "case", record_property, "smoke")


@pytest.mark.slow
def test_the_real_command_refuses_hostile_archives_without_a_traceback(pristine: Pristine, scratch: Path) -> None:
    """`python -m graphpersist` as a user runs it, on cases of every family that must be refused."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "overlays" / "graphpersist"), PYTHONDONTWRITEBYTECODE="1")
    picks: dict[str, Case] = {}
    for case in build_cases(pristine):
        if case.refuse == EVERY_READER and case.family not in picks:
            picks[case.family] = case
    picks |= {c.name: c for c in build_cases(pristine) if c.family == "escape-laden"}
    chosen = list(picks.values())[:CLI_SUBPROCESS_CASES]
    for i, case in enumerate(chosen):
        work = scratch / f"cli{i}"
        shutil.copytree(pristine.root, work, symlinks=True, copy_function=os.link)
        case.apply(work)
        for command in (["check"], ["inspect"], ["inspect", "--json"]):
            ran = subprocess.run([sys.executable, "-m", "graphpersist", *command, str(work)], env=env,
                                 capture_output=True, text=True, cwd=REPO, timeout=60)  # fmt: skip
            text = ran.stdout + ran.stderr
            assert ran.returncode in (0, 1, 2, 3) and "Traceback" not in text, f"{case.name}: {text[-500:]}"
            assert not [c for c in CONTROL if c in text], f"{case.name}: {text[:300]!r}"
            if case.refuse == EVERY_READER:
                assert ran.returncode == 2 and "cannot open archive" in ran.stderr, f"{case.name}: {text[-500:]}"


# ----------------------------------------------------------------------------------------------- name resolution
# An archive is data, never code (issue 41). Forged records (every digest recomputed) of an SGLang-like rank 0 whose
# break function, or an output dataclass's type (in the graph index or inside a break's arguments), names code: module
# paths, dunders, os:system, builtins:eval, torch.ops paths, records in format 2's shape, and ids no registry holds.
# Through the readers above, `check` and rank 0's LOAD refuse whatever is not an id (the closed shape they can know
# without the engine); test_name_resolution_reaches_nothing_at_the_engine takes every case on to SGLang's glue (its
# live registry) as LOAD would: each is refused there at the latest, and nothing is ever called or imported.

NAMES: list[Any] = [
    "os:system", "os:popen", "os.system:__call__", "builtins:eval", "builtins:exec", "builtins:__import__",
    "__import__", "__builtins__", "os.__dict__", "a.__class__.__init__", "sglang.attention.__globals__",
    "torch.ops:aten.empty", "torch.ops:sglang.unified_attention_with_output", "torch.ops.aten.empty.default",
    "sglang.srt.layers.radix_attention:unified_attention_with_output", "graphpersist.load:LoadedGraph",
    "subprocess:Popen", "importlib:import_module", "pickle:loads", "sys:modules", "SGLANG.ATTENTION",
    "sglang..attention", "sglang.attention\n", " sglang.attention", "", "x" * 65, 7, None, True, ["os", "system"],
    {"module": "os"},
    # id-shaped: check cannot tell them from ids; the live registry lacks them
    "os.system", "builtins.eval", "sys.modules", "subprocess.popen", "torch.ops.aten.empty", "sglang.no_such_break",
    "sglang.logits_processor_output", "sglang.attention",
]  # fmt: skip
_MIB = 1 << 20


def _sglang_notes(fn: Any = "sglang.attention", arg: dict[str, Any] | None = None, kind: bool = True) -> dict:
    """SGLang's notes of one rank: a decode graph and a breakable prefill graph whose one break is the attention op
    on a tensor of the rank (plus `arg`), as SAVE writes them (format 2's shape without `kind`)."""
    from archive_fixtures import REGION_BASE

    spec = {"addr": REGION_BASE + 64 * _MIB + 512, "dtype": "bfloat16", "shape": [8, 64], "stride": [64, 1]}
    items = [{"kind": "tensor", "spec": spec}, {"kind": "value", "value": True}, *([arg] if arg else [])]
    record = {
        "kind": "call",
        "fn": fn,
        "args": {"kind": "tuple", "items": items},
        "kwargs": {"kind": "dict", "keys": [], "items": []},
        "output": {"kind": "value", "value": None},
    }
    if not kind:
        del record["kind"]
    return {"decode": {"decode/1": {"size": 1}}, "prefill": {"prefill/16": {"size": 16, "segments": 2,
                                                                            "breaks": [record]}}}  # fmt: skip


def _with_notes(notes: dict[str, Any], outputs: dict[str, Any] | None = None) -> Callable[[Path], None]:
    def change(record: dict[str, Any], index: dict[str, Any]) -> None:
        if "extra" in record:
            record["extra"]["engine_notes"] = notes
        if outputs is not None:
            for g in index["graphs"][:1]:
                g["outputs"] = outputs

    return _edit_record_and_index(change)


def name_resolution_cases() -> list[Case]:
    from graphpersist.graph import structure

    cases = [Case("name resolution", "SGLang notes as SAVE writes them", _with_notes(_sglang_notes()),
                  binding=frozenset())]  # fmt: skip
    for name in NAMES:
        refuse = frozenset() if structure.is_id(name) else rank_readers(0)
        shown_name = repr(name)[:50]
        dataclass = {"kind": "dataclass", "type": name, "fields": {}}
        if name != "sglang.attention":  # SGLang's registered break: the one that installs
            cases.append(Case("name resolution", f"break fn {shown_name}", _with_notes(_sglang_notes(fn=name)),
                              refuse=refuse, binding=frozenset()))  # fmt: skip
        if name != "sglang.logits_processor_output":  # its registered output type
            cases += [
                Case("name resolution", f"break arg type {shown_name}", _with_notes(_sglang_notes(arg=dataclass)),
                     refuse=refuse, binding=frozenset()),
                Case("name resolution", f"output type {shown_name}", _with_notes(_sglang_notes(), outputs=dataclass),
                     refuse=refuse, binding=frozenset()),
            ]  # fmt: skip
        if isinstance(name, str) and ":" in name:  # format 2's records, as they named code
            old = {"kind": "dataclass", "class": name, "fields": {}}
            cases += [
                Case("name resolution", f"format 2 break fn {shown_name}", _with_notes(_sglang_notes(fn=name,
                     kind=False)), refuse=rank_readers(0), binding=frozenset()),
                Case("name resolution", f"format 2 output class {shown_name}", _with_notes(_sglang_notes(),
                     outputs=old), refuse=rank_readers(0), binding=frozenset()),
            ]  # fmt: skip
    return cases


@dataclasses.dataclass
class StandInLogitsProcessorOutput:
    """The dataclass SGLang's registry names "sglang.logits_processor_output" (a stand-in: no SGLang here)."""

    next_token_logits: Any = None


@pytest.fixture
def sglang_glue(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """SGLang's glue imported from the overlay (as test_engine_sglang_persist_cpu does), with stand-ins for the upstream
    modules install() and the registry import, tensors as their specs, and the sinks a forged name could reach."""
    import builtins
    import importlib
    from types import ModuleType, SimpleNamespace

    from graphpersist import engine

    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
    packages = {"sglang": REPO / "overlays/sglang/sglang", "sglang.srt": REPO / "overlays/sglang/sglang/srt"}
    for name, folder in packages.items():
        package = ModuleType(name)
        package.__path__ = [str(folder)]
        monkeypatch.setitem(sys.modules, name, package)
    op_calls: list[Any] = []
    standins = {
        "sglang.srt.model_executor.runner.shape_key": {"ShapeKey": lambda size: size},
        "sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph": {
            "BreakableCUDAGraph": lambda deduped: SimpleNamespace(), "_copy_output": lambda dst, src: src},
        "sglang.srt.layers.radix_attention": {"unified_attention_with_output": lambda *a: op_calls.append(a)},
        "sglang.srt.layers.logits_processor": {"LogitsProcessorOutput": StandInLogitsProcessorOutput},
    }  # fmt: skip
    for name, attrs in standins.items():
        module = ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    glue = SimpleNamespace(**{m: importlib.import_module(f"sglang.srt.graphpersist_{m}")
                              for m in ("capture", "registry", "adapter")})  # fmt: skip
    monkeypatch.setattr(engine, "tensor_at", lambda spec: ("tensor", spec["addr"]))
    glue.op_calls, glue.sinks = op_calls, []
    for owner, name in ((os, "system"), (os, "popen"), (subprocess, "Popen"), (builtins, "eval"),
                        (importlib, "import_module")):  # fmt: skip
        monkeypatch.setattr(owner, name, lambda *a, _n=name, **k: glue.sinks.append((_n, a)))
    yield glue
    for name in [m for m in sys.modules if m.startswith("sglang.")]:
        sys.modules.pop(name, None)


def _engine_stage(root: Path, glue: Any) -> str:
    """Rank 0's LOAD as SGLang runs it, up to the first replay: the CPU stage, each graph's outputs rebuilt with the
    adapter's registry of output types (what load() does), then the glue's install() of the notes into stand-in
    runners, and each rebuilt break run once. "refused: <by>" or "installed"."""
    from types import SimpleNamespace

    from graphpersist.errors import PersistError
    from graphpersist.graph import structure

    try:
        plan = loadstage.rank_stage(open_archive(root, keep_rank=0), 0)
    except ArchiveError:
        return "refused: CPU stage"
    types = glue.adapter.SglangAdapter(SimpleNamespace()).output_types()
    runners = {"decode": SimpleNamespace(capture_bs=[1], backend=SimpleNamespace(_graphs={}, _outputs={})),
               "prefill": SimpleNamespace(capture_num_tokens=[16], backend=SimpleNamespace(
                   _graphs={}, _outputs={}, _capture_inputs={}))}  # fmt: skip
    result = {n: SimpleNamespace(outputs=n) for n in ("decode/1", "prefill/16/000", "prefill/16/001")}
    try:
        for name, (_desc, _blob, _table, entry) in plan.graphs.items():
            structure.decode(entry.outputs, lambda spec: spec, f"graph {name!r} outputs", types)
        glue.capture.install(runners, result, plan.notes)
    except (PersistError, structure.StructureError):
        return "refused: engine"
    for fn in runners["prefill"].backend._graphs[16]._break_fns:
        fn()
    return "installed"


def test_name_resolution_reaches_nothing_at_the_engine(
    pristine: Pristine, scratch: Path, sglang_glue: Any, record_property: Callable[[str, object], None]
) -> None:
    """Every name-resolution case is refused by rank 0's CPU stage or by SGLang's live registry, and nothing a forged
    name could reach (os.system, os.popen, subprocess.Popen, eval, importlib.import_module) is called; the notes as
    SAVE writes them install, and their break calls the registry's attention op."""
    outcomes: Counter[str] = Counter()
    failures = []
    for i, case in enumerate(name_resolution_cases()):
        work = scratch / "names"
        if work.exists():
            shutil.rmtree(work)
        shutil.copytree(pristine.root, work, symlinks=True, copy_function=os.link)
        case.apply(work)
        started = cpu_seconds()
        outcome = _engine_stage(work, sglang_glue)
        outcomes[outcome] += 1
        want = "installed" if i == 0 else "refused: CPU stage" if case.refuse else "refused: engine"
        if outcome != want or cpu_seconds() - started > CASE_SECONDS:
            failures.append(f"{case.name}: {outcome}, want {want}")
    record_property("names", f"name resolution at the engine: {dict(outcomes)}")
    assert not failures, "\n".join(failures)
    assert sglang_glue.sinks == [] and len(sglang_glue.op_calls) == 1
