"""Apply a patch series to an unpacked upstream tree with zero fuzz and zero offset, or classify how it applies.

Strict mode is what the build uses: the pinned upstream must match every hunk exactly, so a patch can never land
somewhere it was not reviewed. Each patch is first classified hunk by hunk with GNU patch (`--dry-run`, which
reports offsets and fuzz per hunk), then applied with `git apply` (all of a patch or none of it). Any hunk that is
not exact stops the series with a message naming the patch, the file and the hunk.

Classify mode is what rebase uses: it says per patch clean / fuzzy (offset or fuzz, with which hunks and by how
much) / conflict (which hunks failed), and never drops a hunk silently.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gptools.series import FileDiff, Patch, SeriesError, load_series

GNU_PATCH = shutil.which("patch") or "/usr/bin/patch"
HUNK_OK_RE = re.compile(r"^Hunk #(\d+) succeeded at (\d+)(?: with fuzz (\d+))?(?: \(offset (-?\d+) lines?\))?\.")
HUNK_FAIL_RE = re.compile(r"^Hunk #(\d+) FAILED at (\d+)")
HUNK_IGNORED_RE = re.compile(r"^Hunk #(\d+) ignored at (\d+)")

CLEAN, FUZZY, CONFLICT = "clean", "fuzzy", "conflict"


class PatchApplyError(RuntimeError):
    """A patch of the series does not apply exactly; the message names patch, file and hunk and says what to do."""

    def __init__(self, message: str, classification: PatchClassification | None = None) -> None:
        super().__init__(message)
        self.classification = classification


@dataclass
class HunkResult:
    """How one hunk applies: exact, offset (same text, other lines), fuzz (context lines ignored) or failed; rebase
    re-labels a placed hunk `conflict` when the 3-way merge conflicts on its lines."""

    file: str
    index: int
    header: str
    status: str
    line: int | None = None
    offset: int = 0
    fuzz: int = 0
    message: str = ""

    def describe(self) -> str:
        where = f"{self.file} hunk #{self.index} ({self.header})"
        if self.status == "exact":
            return f"{where}: exact"
        if self.status == "failed":
            at = f" at line {self.line}" if self.line else ""
            return f"{where}: FAILED{at}{': ' + self.message if self.message else ''}"
        if self.status == CONFLICT:
            return f"{where}: CONFLICT: {self.message}"
        bits = []
        if self.offset:
            bits.append(f"offset {self.offset:+d} lines")
        if self.fuzz:
            bits.append(f"fuzz {self.fuzz}")
        return f"{where}: applies at line {self.line} with {', '.join(bits)}"


@dataclass
class PatchClassification:
    name: str
    subject: str
    status: str
    hunks: list[HunkResult] = field(default_factory=list)
    note: str = ""

    @property
    def not_exact(self) -> list[HunkResult]:
        return [h for h in self.hunks if h.status != "exact"]

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class PatchResult:
    """One patch applied (or checked, in a dry run) exactly: what the build log and `apply --json` show."""

    name: str
    subject: str
    files: list[str]
    hunks: int
    applied: bool


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("POSIXLY_CORRECT", None)
    env["LC_ALL"] = "C"
    env["GIT_CONFIG_NOSYSTEM"] = "1"
    env["GIT_CONFIG_GLOBAL"] = os.devnull
    return env


def _git_apply(tree: Path, patch_file: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """`git apply` rooted at `tree`: the ceiling keeps git from treating an enclosing repository's root as the
    patch root (then it would silently skip files outside the current directory)."""
    env = _env()
    if not (tree / ".git").exists():
        env["GIT_CEILING_DIRECTORIES"] = str(tree.resolve().parent)
        env.pop("GIT_DIR", None)
        env.pop("GIT_WORK_TREE", None)
    return subprocess.run(
        ["git", "apply", "--verbose", "--whitespace=nowarn", *extra, str(patch_file.resolve())],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )


def classify_file(tree: Path, fd: FileDiff, *, apply: bool = False) -> list[HunkResult]:
    """Per-hunk status of one file's diff against `tree`, via GNU patch (fuzz up to 2, like its default)."""
    with tempfile.NamedTemporaryFile(
        "w", suffix=".diff", delete=False, encoding="utf-8", errors="surrogateescape"
    ) as f:
        f.write(fd.text)
        chunk = Path(f.name)
    try:
        cmd = [GNU_PATCH, "-p1", "--force", "--fuzz=2", "--no-backup-if-mismatch", "-d", str(tree), "-i", str(chunk)]
        cmd += ["--reject-file=-"] if apply else ["--dry-run"]
        proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True)
    finally:
        chunk.unlink()
    out = proc.stdout + proc.stderr
    results = {h.index: HunkResult(fd.path, h.index, h.header, "exact", h.old_start) for h in fd.hunks}
    for line in out.splitlines():
        if m := HUNK_OK_RE.match(line):
            r = results.get(int(m.group(1)))
            if r:
                r.line = int(m.group(2))
                r.fuzz = int(m.group(3) or 0)
                r.offset = int(m.group(4) or 0)
                r.status = "fuzz" if r.fuzz else ("offset" if r.offset else "exact")
        elif (m := HUNK_FAIL_RE.match(line)) or (m := HUNK_IGNORED_RE.match(line)):
            r = results.get(int(m.group(1)))
            if r:
                r.status, r.line = "failed", int(m.group(2))
                r.message = "context does not match" if "FAILED" in line else "ignored by patch"
    trouble = [
        ln.strip()
        for ln in out.splitlines()
        if any(k in ln for k in ("can't find file", "Skipping patch", "already exists", "Reversed", "No file to"))
    ]
    if proc.returncode != 0 or trouble:
        failed = [r for r in results.values() if r.status == "failed"]
        if not failed or trouble:
            # GNU patch gave up on the whole file (missing file, file already exists, ...): every hunk failed.
            last = out.strip().splitlines()[-1] if out.strip() else f"GNU patch exit {proc.returncode}"
            why = "; ".join(trouble) or last
            for r in results.values():
                if r.status != "failed":
                    r.status, r.message = "failed", why
    if not fd.hunks and proc.returncode != 0:
        return [HunkResult(fd.path, 0, "(file-level change)", "failed", None, message=out.strip()[-200:])]
    return [results[i] for i in sorted(results)]


def classify_patch(tree: Path, patch: Patch, *, apply: bool = False) -> PatchClassification:
    """clean: every hunk exact; fuzzy: every hunk applies, some with offset/fuzz; conflict: some hunk fails.
    With apply=True the applicable hunks are written (GNU patch), so the next patch sees them."""
    hunks: list[HunkResult] = []
    for fd in patch.files:
        hunks.extend(classify_file(tree, fd, apply=apply))
    if any(h.status == "failed" for h in hunks):
        status = CONFLICT
    elif any(h.status != "exact" for h in hunks):
        status = FUZZY
    else:
        status = CLEAN
    return PatchClassification(patch.name, patch.header.subject, status, hunks)


def _engine_hint(patches_dir: Path) -> str:
    engine = patches_dir.name
    return f"run `make edit ENGINE={engine}` to fix the patch in a git work tree, then `make export ENGINE={engine}`"


def apply_patch(tree: Path, patch: Patch, *, hint: str = "") -> PatchResult:
    """Apply one patch exactly (no fuzz, no offset) or raise PatchApplyError; never applies half a patch."""
    cls = classify_patch(tree, patch)
    if cls.status != CLEAN:
        lines = [f"patch {patch.name} ({patch.header.subject}) does not apply exactly to {tree}:"]
        lines += [f"  {h.describe()}" for h in cls.not_exact]
        if hint:
            lines.append(hint)
        raise PatchApplyError("\n".join(lines), cls)
    check = _git_apply(tree, patch.path, "--check")
    if check.returncode != 0:
        raise PatchApplyError(_git_failure(patch, check.stderr, hint), cls)
    done = _git_apply(tree, patch.path)
    if done.returncode != 0:
        raise PatchApplyError(_git_failure(patch, done.stderr, hint), cls)
    reported = set(re.findall(r"^Applied patch (.+?) cleanly\.$", done.stderr, re.MULTILINE))
    expected = {f.path for f in patch.files}
    if not expected <= reported:
        missing = ", ".join(sorted(expected - reported))
        raise PatchApplyError(f"patch {patch.name}: git apply did not report applying {missing}; {hint}", cls)
    return PatchResult(patch.name, patch.header.subject, sorted(expected), patch.hunk_count, applied=True)


def _git_failure(patch: Patch, stderr: str, hint: str) -> str:
    """Turn `error: patch failed: FILE:LINE` into the hunk it means (git names the hunk's old start line)."""
    lines = [f"patch {patch.name} ({patch.header.subject}) does not apply:"]
    for file, line in re.findall(r"^error: patch failed: (.+):(\d+)$", stderr, re.MULTILINE):
        hunk = next(
            (h for f in patch.files if f.path == file for h in f.hunks if h.old_start == int(line)),
            None,
        )
        what = f"hunk #{hunk.index} ({hunk.header})" if hunk else f"hunk at line {line}"
        lines.append(f"  {file} {what}: FAILED")
    lines += [f"  git: {ln}" for ln in stderr.strip().splitlines() if ln.startswith("error:")][:6]
    if hint:
        lines.append(hint)
    return "\n".join(lines)


def touched_paths(patches: list[Patch]) -> set[str]:
    return {p for patch in patches for f in patch.files for p in (f.old_path, f.new_path) if p}


def apply_series(tree: Path, patches_dir: Path, *, dry_run: bool = False) -> list[PatchResult]:
    """Apply `patches_dir/series` in order into `tree` in place (the caller passes a writable copy).

    dry_run checks the whole series without touching `tree`: the files the series touches are copied to a
    scratch folder and the series is applied there, so later patches see earlier ones as in a real build.
    """
    try:
        patches = load_series(patches_dir)
    except SeriesError as exc:
        raise PatchApplyError(f"{exc}; run `python -m gptools lint`") from exc
    hint = _engine_hint(patches_dir)
    if dry_run:
        with tempfile.TemporaryDirectory(prefix="gptools-dry-") as tmp:
            scratch = Path(tmp) / "tree"
            scratch.mkdir()
            for rel in touched_paths(patches):
                src = tree / rel
                if src.is_file():
                    (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, scratch / rel)
            results = [apply_patch(scratch, p, hint=hint) for p in patches]
        for r in results:
            r.applied = False
        return results
    return [apply_patch(tree, p, hint=hint) for p in patches]


def classify_series(tree: Path, patches_dir: Path) -> list[PatchClassification]:
    """Classify each patch in order on `tree` (modified in place: pass a copy). Applicable hunks are applied so
    later patches see earlier ones; a conflicting patch is applied only in its applicable hunks and says so."""
    out = []
    for patch in load_series(patches_dir):
        cls = classify_patch(tree, patch)
        classify_patch(tree, patch, apply=True)
        if cls.status == CONFLICT:
            cls.note = "only its applicable hunks were applied before classifying later patches"
        out.append(cls)
    return out


def copy_tree(src: Path, dest: Path) -> None:
    """A real copy (not hard links): editing the copy in place must never reach the pristine upstream tree."""
    shutil.copytree(src, dest, symlinks=True)


# ---------------------------------------------------------------------------------------------------- CLI


def _cmd_apply(args: argparse.Namespace) -> int:
    from gpdist import REPO_ROOT, pins
    from gpdist.unpack import upstream_tree
    from gptools.series import engines_arg, patches_dir_for

    engines = engines_arg(args.engine)
    if len(engines) > 1 and (args.tree or args.patches_dir):
        print("gptools apply: --tree/--patches-dir need a single --engine", file=sys.stderr)
        return 2
    status = 0
    report: dict[str, object] = {}
    loaded = pins.load()
    for engine in engines:
        pin = loaded.engine(engine)
        pdir = patches_dir_for(engine, args.patches_dir)
        if args.tree:
            tree = Path(args.tree)
            if not tree.is_dir():
                print(f"gptools apply: --tree {tree} is not a directory", file=sys.stderr)
                return 2
        else:
            print(f"apply {engine}: preparing pristine upstream {pin.project} {pin.version}", file=sys.stderr)
            tree = upstream_tree(pin)
        if args.classify:
            scratch = Path(tempfile.mkdtemp(prefix="gptools-classify-"))
            try:
                patches = load_series(pdir)
                for rel in touched_paths(patches):
                    if (tree / rel).is_file():
                        (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(tree / rel, scratch / rel)
                results = classify_series(scratch, pdir)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            report[engine] = [r.to_json() for r in results]
            if not args.json:
                for r in results:
                    print(f"{engine}: {r.status:8} {r.name}")
                    for h in r.not_exact:
                        print(f"    {h.describe()}")
            if any(r.status != CLEAN for r in results):
                status = 1
            continue
        if not args.dry_run and not args.tree:
            dest = REPO_ROOT / ".work" / "apply" / f"{engine}-{pin.version}"
            print(f"apply {engine}: copying the pristine tree to {dest}", file=sys.stderr)
            shutil.rmtree(dest, ignore_errors=True)
            copy_tree(tree, dest)
            tree = dest
        print(f"apply {engine}: {'checking' if args.dry_run else 'applying'} {pdir}/series", file=sys.stderr)
        try:
            results = apply_series(tree, pdir, dry_run=args.dry_run)
        except PatchApplyError as exc:
            print(f"gptools apply {engine}: {exc}", file=sys.stderr)
            report[engine] = {"error": str(exc)}
            status = 1
            continue
        report[engine] = [asdict(r) for r in results]
        if not args.json:
            for r in results:
                print(f"{engine}: {'checked' if args.dry_run else 'applied'} {r.name} ({r.hunks} hunks, exact)")
            where = "" if args.dry_run else f" into {tree}"
            print(f"{engine}: {len(results)} patch(es) apply with zero fuzz and zero offset{where}")
    if args.json:
        print(json.dumps(report, indent=2))
    return status


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "apply",
        help="apply the series to the pinned upstream with zero fuzz",
        description="Apply patches/<engine>/series in order with zero fuzz and zero offset. Without --tree the "
        "pristine pinned upstream is copied to .work/apply/<engine>-<version> first. Exit 1 when a patch does "
        "not apply exactly.",
    )
    p.add_argument("--engine", default="all", help="engine name or `all` (default)")
    p.add_argument("--dry-run", action="store_true", help="check only; write nothing")
    p.add_argument("--tree", help="an unpacked tree to patch in place instead of a fresh copy of the pinned one")
    p.add_argument("--patches-dir", help="use this series folder instead of patches/<engine>/")
    p.add_argument("--classify", action="store_true", help="report clean / fuzzy / conflict per patch and hunk")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_apply)
