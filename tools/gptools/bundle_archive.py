"""The transport half of a bundle: trimming an engine wheel on request, one archive split into parts, the manifest
of sha256s, the verifier and the generated install.sh."""

from __future__ import annotations

import fnmatch
import hashlib
import io
import json
import os
import shlex
import shutil
import subprocess
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpdist.fetch import sha256_file
from gpdist.wheelmeta import record_digest

MiB = 1 << 20
CHUNK = 1 << 20
FORMAT = "gpbundle/1"
COMPRESSIONS = {"gz": ".tar.gz", "xz": ".tar.xz", "none": ".tar"}


def parse_size(text: str) -> int:
    """'60MiB', '60M', '1.5GiB', '1048576' -> bytes (K/M/G are binary: the parts' limit is a transfer limit)."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (examples: 60MiB, 512KiB, 1048576)") from None


# --------------------------------------------------------------------------------------------------------------------
# Trimming an engine wheel for transfer (explicit --drop-path only)


@dataclass
class TrimResult:
    dropped: list[tuple[str, int]]  # (path inside the wheel, uncompressed size)
    unmatched: list[str]  # globs that matched nothing


def trim_wheel(src: Path, dest: Path, globs: list[str], original_sha256: str, store: bool = False) -> TrimResult:
    """Copy wheel `src` to `dest` without the entries matching any glob (fnmatch on the path inside the wheel,
    `*` crosses '/'), rewrite RECORD without them and add `<dist-info>/GP_BUNDLE_DROPPED` (listed in RECORD) naming
    what was dropped and the original wheel's sha256, so an installed tree says it is trimmed.
    store=True writes entries uncompressed (the outer xz compresses better than deflate)."""
    matched: set[str] = set()
    dropped: list[tuple[str, int]] = []
    with zipfile.ZipFile(src) as zin:
        infos = zin.infolist()
        records = [i.filename for i in infos if i.filename.endswith(".dist-info/RECORD") and i.filename.count("/") == 1]
        if len(records) != 1:
            raise ValueError(f"{src.name}: expected one *.dist-info/RECORD, found {len(records)}")
        record_name = records[0]
        dist_info = record_name.rsplit("/", 1)[0]
        keep = []
        for info in infos:
            hits = [g for g in globs if fnmatch.fnmatchcase(info.filename, g)]
            if hits and not info.filename.startswith(dist_info + "/"):
                matched.update(hits)
                dropped.append((info.filename, info.file_size))
            else:
                keep.append(info)
        dropped_names = {d for d, _ in dropped}
        note_name = f"{dist_info}/GP_BUNDLE_DROPPED"
        note = (
            "# Removed from this wheel for transfer by `gptools bundle --drop-path`; not a product change.\n"
            f"# original wheel: {src.name} sha256={original_sha256}\n"
            + "".join(f"# glob: {g}\n" for g in globs)
            + "".join(f"{name}\n" for name, _ in dropped)
        ).encode()
        tmp = dest.with_name(dest.name + ".tmp")
        compression = zipfile.ZIP_STORED if store else zipfile.ZIP_DEFLATED
        with zipfile.ZipFile(tmp, "w", compression=compression) as zout:
            for info in keep:
                if info.filename == record_name:
                    continue
                out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                out.external_attr = info.external_attr
                out.compress_type = compression
                with zin.open(info) as fin, zout.open(out, "w", force_zip64=True) as fout:
                    shutil.copyfileobj(fin, fout, CHUNK)
            note_info = zipfile.ZipInfo(note_name, date_time=keep[0].date_time)
            note_info.external_attr = 0o644 << 16
            zout.writestr(note_info, note, compress_type=compression)
            lines = []
            for line in zin.read(record_name).decode().splitlines():
                path = line.rsplit(",", 2)[0] if line.count(",") >= 2 else line
                if path.strip('"') in dropped_names or not line.strip():
                    continue
                lines.append(line)
            lines.insert(
                len(lines) - 1 if lines and lines[-1].startswith(record_name) else len(lines),
                f"{note_name},{record_digest(note)},{len(note)}",
            )
            if not any(ln.startswith(record_name + ",") for ln in lines):
                lines.append(f"{record_name},,")
            rec_info = zipfile.ZipInfo(record_name, date_time=keep[0].date_time)
            rec_info.external_attr = 0o644 << 16
            zout.writestr(rec_info, "\n".join(lines) + "\n", compress_type=compression)
        tmp.replace(dest)
    return TrimResult(dropped=dropped, unmatched=[g for g in globs if g not in matched])


def check_record(wheel: Path) -> list[str]:
    """Problems with a wheel's RECORD: every file listed once with a correct hash and size, nothing unlisted."""
    problems = []
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if not n.endswith("/")]
        record = next(n for n in names if n.endswith(".dist-info/RECORD") and n.count("/") == 1)
        listed = {}
        for line in zf.read(record).decode().splitlines():
            if line.strip():
                path, digest, size = line.rsplit(",", 2)
                listed[path] = (digest, size)
        for n in names:
            if n not in listed:
                problems.append(f"{n}: not in RECORD")
                continue
            digest, size = listed[n]
            if n == record:
                continue
            data = zf.read(n)
            if digest != record_digest(data) or size != str(len(data)):
                problems.append(f"{n}: RECORD hash/size mismatch")
        problems += [f"{p}: in RECORD but not in the wheel" for p in listed if p not in names]
    return problems


# --------------------------------------------------------------------------------------------------------------------
# One archive, split into parts as it is written


@dataclass
class PartInfo:
    name: str
    size: int
    sha256: str


class SplitWriter(io.RawIOBase):
    """A write-only stream that cuts what it gets into files of at most `part_size` bytes, hashing each part and the
    whole, so the archive never exists in one piece on disk."""

    def __init__(self, out_dir: Path, stem: str, part_size: int):
        super().__init__()
        if part_size < 1:
            raise ValueError("part size must be positive")
        self.out_dir, self.stem, self.part_size = out_dir, stem, part_size
        self.parts: list[PartInfo] = []
        self.whole = hashlib.sha256()
        self.total = 0
        self._f = None
        self._h = None
        self._n = 0

    def writable(self) -> bool:
        return True

    def _open_next(self) -> None:
        self._close_part()
        name = f"{self.stem}.part{len(self.parts):03d}"
        self._f = (self.out_dir / name).open("wb")
        self._h = hashlib.sha256()
        self._n = 0
        self._name = name

    def _close_part(self) -> None:
        if self._f is not None:
            self._f.close()
            self.parts.append(PartInfo(self._name, self._n, self._h.hexdigest()))
            self._f = None

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        done = 0
        while done < len(view):
            if self._f is None or self._n == self.part_size:
                self._open_next()
            take = min(self.part_size - self._n, len(view) - done)
            chunk = view[done : done + take]
            self._f.write(chunk)
            self._h.update(chunk)
            self.whole.update(chunk)
            self._n += take
            self.total += take
            done += take
        return done

    def close(self) -> None:
        if not self.closed:
            if self._f is None and not self.parts:
                self._open_next()  # an empty archive still has one (empty) part
            self._close_part()
        super().close()


def write_archive(
    members: list[tuple[str, Path]],
    out_dir: Path,
    stem: str,
    compression: str,
    part_size: int,
    progress: Callable[[str], None] = lambda s: None,
) -> tuple[SplitWriter, str]:
    """Write a tar (gz/xz/none) of `members` [(name in archive, file)] straight into parts. Returns the writer (parts,
    whole sha256, total size) and the archive's file name once joined."""
    archive_name = stem + COMPRESSIONS[compression]
    split = SplitWriter(out_dir, archive_name, part_size)
    proc = None
    if compression == "gz":
        import gzip

        sink = gzip.GzipFile(filename="", mode="wb", fileobj=split, compresslevel=6, mtime=0)
    elif compression == "xz":
        if shutil.which("xz"):
            proc = subprocess.Popen(["xz", "-T0", "-6", "-c"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            sink = proc.stdin
        else:
            import lzma

            sink = lzma.LZMAFile(split, "wb", preset=6)  # noqa: SIM115 (closed below, after the tar)
    else:
        sink = split

    import threading

    pump = None
    if proc is not None:

        def _pump() -> None:
            while chunk := proc.stdout.read(CHUNK):
                split.write(chunk)

        pump = threading.Thread(target=_pump, daemon=True)
        pump.start()
    with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for name, path in members:
            progress(f"  + {name} ({path.stat().st_size / MiB:.1f} MiB)")
            info = tar.gettarinfo(str(path), arcname=name)
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mtime = 0
            with path.open("rb") as f:
                tar.addfile(info, f)
    sink.close()
    if proc is not None:
        pump.join()
        if proc.wait() != 0:
            raise RuntimeError("xz failed")
    split.close()
    return split, archive_name


# --------------------------------------------------------------------------------------------------------------------
# Verification (Python side; install.sh does the same in bash)


@dataclass
class VerifyResult:
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_bundle(bundle_dir: Path, progress: Callable[[str], None] = lambda s: None) -> VerifyResult:
    """Check every part named in manifest.json (present, size, sha256), then the joined archive's sha256."""
    res = VerifyResult()
    manifest_path = bundle_dir / "manifest.json"
    if not manifest_path.exists():
        res.problems.append(f"{manifest_path}: missing (not a bundle folder?)")
        return res
    manifest = json.loads(manifest_path.read_text())
    whole = hashlib.sha256()
    for part in manifest["parts"]:
        path = bundle_dir / part["name"]
        if not path.exists():
            res.problems.append(f"part {part['name']}: MISSING")
            continue
        digest = sha256_file(path)
        size = path.stat().st_size
        if digest != part["sha256"] or size != part["size"]:
            res.problems.append(
                f"part {part['name']}: CORRUPTED (sha256 {digest[:16]}…, {size} bytes; "
                f"expected {part['sha256'][:16]}…, {part['size']} bytes)"
            )
        else:
            progress(f"  ok {part['name']} ({size / MiB:.1f} MiB)")
    if res.problems:
        return res
    for part in manifest["parts"]:
        with (bundle_dir / part["name"]).open("rb") as f:
            while chunk := f.read(CHUNK):
                whole.update(chunk)
    if whole.hexdigest() != manifest["archive"]["sha256"]:
        res.problems.append(f"joined archive {manifest['archive']['name']}: sha256 mismatch")
    return res


# --------------------------------------------------------------------------------------------------------------------
# install.sh

INSTALL_SH = r"""#!/usr/bin/env bash
# Offline installer for the graphpersist bundle @ENGINE@ (generated by `gptools bundle`; do not edit).
# Verifies every part and the joined archive by sha256, unpacks it, verifies every wheel, then installs them with
# `python3 -m pip install --no-index --no-deps`. Needs bash, python3 with pip; no network.
set -euo pipefail
usage() {
  cat <<'EOF'
usage: install.sh [--target DIR] [--python PY] [--workdir DIR] [--verify-only] [--keep] [-- PIP_ARGS...]
  --target DIR    install into DIR (pip --target; for read-only site-packages), then use PYTHONPATH=DIR
  --python PY     interpreter whose pip installs (default: python3, or $PYTHON)
  --workdir DIR   where the archive is joined and unpacked (default: a temporary folder, removed afterwards)
  --verify-only   verify the parts and the archive, install nothing
  --keep          keep the work folder
exit codes: 0 installed (or verified), 1 a part or wheel failed verification or pip failed, 2 misuse
EOF
}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-python3}; TARGET=""; WORK=""; VERIFY_ONLY=0; KEEP=0; PIP_EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --target) [[ $# -ge 2 ]] || { usage >&2; exit 2; }; TARGET=$2; shift 2 ;;
    --python) [[ $# -ge 2 ]] || { usage >&2; exit 2; }; PY=$2; shift 2 ;;
    --workdir) [[ $# -ge 2 ]] || { usage >&2; exit 2; }; WORK=$2; shift 2 ;;
    --verify-only) VERIFY_ONLY=1; shift ;;
    --keep) KEEP=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; PIP_EXTRA=("$@"); break ;;
    *) echo "install.sh: unknown argument: $1" >&2; usage >&2; exit 2 ;;
  esac
done
say() { echo "install.sh: $*"; }
die() { echo "install.sh: ERROR: $*" >&2; exit 1; }
sha256() {
  if command -v sha256sum >/dev/null 2>&1; then sha256sum "$1" | cut -d' ' -f1
  else "$PY" -c 'import hashlib,sys
h=hashlib.sha256()
with open(sys.argv[1],"rb") as f:
    for b in iter(lambda: f.read(1<<20), b""): h.update(b)
print(h.hexdigest())' "$1"; fi
}
# name sha256 size
PARTS=(
@PARTS@
)
ARCHIVE=@ARCHIVE@
ARCHIVE_SHA256=@ARCHIVE_SHA256@
ROOT=@ROOT@
# file sha256 | what (why)
WHEELS=(
@WHEELS@
)
say "bundle @ENGINE@: ${#PARTS[@]} part(s), ${#WHEELS[@]} wheel(s)"
bad=()
for entry in "${PARTS[@]}"; do
  read -r name want size <<<"$entry"
  if [[ ! -f "$HERE/$name" ]]; then bad+=("part $name is MISSING (expected in $HERE)"); continue; fi
  got=$(sha256 "$HERE/$name")
  if [[ "$got" != "$want" ]]; then
    bad+=("part $name is CORRUPTED: sha256 $got, expected $want")
  else
    say "ok   $name ($size bytes)"
  fi
done
if [[ ${#bad[@]} -gt 0 ]]; then
  for b in "${bad[@]}"; do echo "install.sh: ERROR: $b" >&2; done
  die "refusing to install: ${#bad[@]} part(s) failed verification; copy them again from the bundle"
fi
CLEAN=0
if [[ -z "$WORK" ]]; then WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpbundle.XXXXXX"); CLEAN=1; else mkdir -p "$WORK"; fi
cleanup() { if [[ $CLEAN -eq 1 && $KEEP -eq 0 ]]; then rm -rf "$WORK"; fi; }
trap cleanup EXIT
: > "$WORK/$ARCHIVE"
for entry in "${PARTS[@]}"; do read -r name _ <<<"$entry"; cat "$HERE/$name" >> "$WORK/$ARCHIVE"; done
got=$(sha256 "$WORK/$ARCHIVE")
[[ "$got" == "$ARCHIVE_SHA256" ]] || die "joined archive $ARCHIVE: sha256 $got, expected $ARCHIVE_SHA256"
say "ok   joined $ARCHIVE (sha256 $ARCHIVE_SHA256)"
if [[ $VERIFY_ONLY -eq 1 ]]; then say "verified; nothing installed (--verify-only)"; exit 0; fi
"$PY" - "$WORK/$ARCHIVE" "$WORK" <<'PYEOF' || die "could not unpack $ARCHIVE"
import sys, tarfile
with tarfile.open(sys.argv[1]) as t:
    if hasattr(tarfile, "data_filter"):
        t.extractall(sys.argv[2], filter="data")
    else:
        t.extractall(sys.argv[2])
PYEOF
rm -f "$WORK/$ARCHIVE"
files=()
for entry in "${WHEELS[@]}"; do
  read -r file want _ <<<"$entry"
  got=$(sha256 "$WORK/$ROOT/wheels/$file") || die "wheel $file missing from the archive"
  [[ "$got" == "$want" ]] || die "wheel $file: sha256 $got, expected $want"
  files+=("$WORK/$ROOT/wheels/$file")
done
DEST=${TARGET:-$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')}
say "installing with $("$PY" -m pip --version | cut -d' ' -f1-2) into $DEST:"
for entry in "${WHEELS[@]}"; do echo "  ${entry#* * }"; done
args=(install --no-index --no-deps --disable-pip-version-check)
if [[ -n "$TARGET" ]]; then mkdir -p "$TARGET"; args+=(--target "$TARGET" --upgrade); fi
"$PY" -m pip "${args[@]}" ${PIP_EXTRA[@]+"${PIP_EXTRA[@]}"} "${files[@]}" || die "pip install failed"
say "installed ${#files[@]} wheel(s)"
if [[ -n "$TARGET" ]]; then
  say "use them with: export PYTHONPATH=$(cd "$TARGET" && pwd)\${PYTHONPATH:+:\$PYTHONPATH}"
fi
"""


def render_install_sh(
    engine: str, archive_name: str, archive_sha256: str, root: str, parts: list[PartInfo], wheels: list[dict]
) -> str:
    part_lines = "\n".join(f"  {shlex.quote(f'{p.name} {p.sha256} {p.size}')}" for p in parts)
    wheel_lines = "\n".join(
        "  " + shlex.quote(f"{w['file']} {w['sha256']} {w['name']} {w['version']} ({w['why']})") for w in wheels
    )
    text = INSTALL_SH
    for key, value in {
        "@ENGINE@": engine,
        "@PARTS@": part_lines,
        "@ARCHIVE@": shlex.quote(archive_name),
        "@ARCHIVE_SHA256@": archive_sha256,
        "@ROOT@": shlex.quote(root),
        "@WHEELS@": wheel_lines,
    }.items():
        text = text.replace(key, value)
    return text


def write_text(path: Path, text: str, mode: int = 0o644) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.chmod(tmp, mode)
    tmp.replace(path)
