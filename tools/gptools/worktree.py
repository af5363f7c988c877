"""The edit loop: materialize upstream + series as a git work tree, edit with plain git, export back to patches.

Layout of a work tree (default .work/edit/<engine>):
  * the base commit (tagged `gp-base`) holds the pristine upstream's text files only: the wheel's native
    libraries stay out of git, which keeps `edit` fast and the patches text-only;
  * one commit per patch on top, message = the patch header, author and date = the patch's From:/Date:.

Export turns `gp-base..HEAD` back into patches with one fixed `git format-patch` invocation (CANONICAL_FORMAT
below), so exporting an unmodified tree reproduces the series byte for byte. Git configuration of the user or
the system never leaks into the patches: every git call here runs with the global/system config ignored and the
options that change output pinned on the command line.
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

from gptools.apply import CLEAN, classify_patch
from gptools.series import NUMBERED_RE, lint, lint_patch, load_series, read_patch, read_series, write_series

BASE_TAG = "gp-base"
META_FILE = "gptools.json"
TOOL_IDENT = {"GIT_COMMITTER_NAME": "gptools", "GIT_COMMITTER_EMAIL": "gptools@localhost"}

# Every setting that changes what format-patch writes, pinned (the user's ~/.gitconfig is ignored as well).
CANONICAL_CONFIG = {
    "core.abbrev": "12",
    "core.quotePath": "true",
    "diff.algorithm": "myers",
    "diff.indentHeuristic": "true",
    "diff.mnemonicPrefix": "false",
    "diff.noprefix": "false",
    "diff.relative": "false",
    "diff.renames": "false",
    "diff.suppressBlankEmpty": "false",
    "diff.context": "3",
    "format.coverLetter": "false",
    "format.encodeEmailHeaders": "true",
    "format.filenameMaxLength": "64",
    "format.numbered": "false",
    "format.thread": "false",
    "format.useAutoBase": "false",
    "i18n.commitEncoding": "UTF-8",
    "i18n.logOutputEncoding": "UTF-8",
    "mailinfo.scissors": "false",
}
CANONICAL_FORMAT = [
    "format-patch",
    "--zero-commit",
    "--no-signature",
    "--full-index",
    "--no-renames",
    "--no-numbered",
    "--subject-prefix=PATCH",
    "--stat=72",
    "--summary",
    "--no-thread",
    "--no-cover-letter",
    "--no-base",
    "--no-binary",
    "-U3",
]

BINARY_SUFFIXES = {
    ".so", ".a", ".o", ".bin", ".pt", ".pth", ".safetensors", ".cubin", ".fatbin", ".whl", ".zip", ".gz",
    ".tgz", ".xz", ".bz2", ".png", ".jpg", ".jpeg", ".gif", ".ico", ".pyc", ".pyd", ".dll", ".dylib", ".npy",
}  # fmt: skip
MAX_TEXT_BYTES = 4 << 20


class WorktreeError(RuntimeError):
    """The work tree is not in a state that can be exported (or created); the message says what to do."""


@dataclass
class WorktreeMeta:
    """Stored in .git/gptools.json so `export --dir` and `rebase` know what a tree was made from."""

    engine: str
    project: str
    version: str
    patches_dir: str
    base_tag: str = BASE_TAG
    old_version: str = ""


@dataclass
class EditResult:
    path: Path
    applied: list[str] = field(default_factory=list)
    inexact: list[str] = field(default_factory=list)
    stopped_at: str = ""
    message: str = ""


@dataclass
class ExportResult:
    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    series_changed: bool = False
    findings: list[str] = field(default_factory=list)

    @property
    def modified(self) -> bool:
        return bool(self.added or self.changed or self.removed or self.series_changed)


def git_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "POSIXLY_CORRECT"):
        env.pop(key, None)
    env.update({"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "LC_ALL": "C", "TZ": "UTC"})
    env.update(TOOL_IDENT)
    env.update(extra or {})
    return env


def git(repo: Path, *args: str, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cfg: list[str] = []
    for key, value in CANONICAL_CONFIG.items():
        cfg += ["-c", f"{key}={value}"]
    proc = subprocess.run(["git", *cfg, *args], cwd=repo, env=git_env(env), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise WorktreeError(f"git {' '.join(args[:3])} failed in {repo}:\n{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def is_text_file(path: Path) -> bool:
    """Only text goes into git: native libraries and archives stay out (patches never touch them)."""
    name = path.name
    if path.suffix.lower() in BINARY_SUFFIXES or ".so." in name or name.startswith("."):
        return False
    try:
        if path.stat().st_size > MAX_TEXT_BYTES:
            return False
        with path.open("rb") as f:
            return b"\0" not in f.read(8192)
    except OSError:
        return False


def copy_text_files(src: Path, dest: Path) -> int:
    count = 0
    for path in sorted(src.rglob("*")):
        if path.is_symlink() or not path.is_file() or not is_text_file(path):
            continue
        rel = path.relative_to(src)
        if rel.parts[0] == ".git" or path.name == ".gpdist-unpacked":
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest / rel)
        count += 1
    return count


def init_repo(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    git(dest, "init", "-q", "-b", "main")
    for key, value in (("core.autocrlf", "false"), ("gc.auto", "0"), ("commit.gpgsign", "false")):
        git(dest, "config", key, value)


def commit_tree_state(repo: Path, message: str, date: str) -> str:
    """Commit everything in the work tree as one snapshot (the upstream base) with a fixed identity and date."""
    git(repo, "add", "-A", ".")
    ident = {
        "GIT_AUTHOR_NAME": "upstream",
        "GIT_AUTHOR_EMAIL": "upstream@localhost",
        "GIT_AUTHOR_DATE": date,
        "GIT_COMMITTER_DATE": date,
    }
    git(repo, "commit", "-q", "--allow-empty", "--no-verify", "-m", message, env=ident)
    return git(repo, "rev-parse", "HEAD").stdout.strip()


def write_meta(repo: Path, meta: WorktreeMeta) -> None:
    (repo / ".git" / META_FILE).write_text(json.dumps(asdict(meta), indent=2) + "\n")


def read_meta(repo: Path) -> WorktreeMeta:
    path = repo / ".git" / META_FILE
    if not path.is_file():
        raise WorktreeError(f"{repo} is not a gptools work tree (no .git/{META_FILE}); create one with `gptools edit`")
    return WorktreeMeta(**json.loads(path.read_text()))


def am(repo: Path, patch_files: list[Path], *, three_way: bool = False) -> subprocess.CompletedProcess:
    """`git am` that keeps the message as written: only a `[PATCH]` prefix is stripped, CRs are kept, the
    committer date equals the author date (so the commits are reproducible)."""
    args = ["am", "-q", "--keep-cr", "--keep-non-patch", "--no-scissors", "--no-message-id"]
    args += ["--whitespace=nowarn", "--committer-date-is-author-date"]
    if three_way:
        args.append("--3way")
    return git(repo, *args, *[str(p.resolve()) for p in patch_files], check=False)


def materialize(
    dest: Path,
    upstream: Path,
    patches_dir: Path,
    meta: WorktreeMeta,
    *,
    base_date: str = "2000-01-01T00:00:00Z",
    force: bool = False,
    progress: bool = True,
) -> EditResult:
    """Create the edit tree: pristine upstream (text files) as `gp-base`, then one commit per patch.

    A patch that does not apply exactly is retried with a 3-way merge (its index lines name the base blobs);
    if that stops on a conflict, `git am` is left in progress with the remaining patches queued, so the author
    resolves, runs `git am --continue`, and exports."""
    if dest.exists() and any(dest.iterdir()):
        if not force:
            raise WorktreeError(f"{dest} already exists; export or remove it first (or pass --force to replace it)")
        shutil.rmtree(dest)
    result = EditResult(path=dest)
    init_repo(dest)
    say = (lambda msg: print(msg, file=sys.stderr)) if progress else (lambda msg: None)
    say(f"edit: copying text files of {upstream} into {dest}")
    count = copy_text_files(upstream, dest)
    say(f"edit: committing {count} upstream files as the base ({BASE_TAG})")
    commit_tree_state(
        dest, f"upstream {meta.project} {meta.version}\n\nPristine text files of the unpacked wheel.", base_date
    )
    git(dest, "tag", "-f", BASE_TAG)
    write_meta(dest, meta)
    patches = load_series(patches_dir)
    for i, patch in enumerate(patches):
        cls = classify_patch(dest, patch)
        if cls.status == CLEAN:
            proc = am(dest, [patch.path])
            if proc.returncode != 0:
                raise WorktreeError(f"git am refused {patch.name} although it applies exactly:\n{proc.stderr.strip()}")
            result.applied.append(patch.name)
            say(f"edit: applied {patch.name}")
            continue
        rest = [p.path for p in patches[i:]]
        say(f"edit: {patch.name} is {cls.status}; replaying it and the rest with a 3-way merge")
        for h in cls.not_exact:
            say(f"    {h.describe()}")
        result.inexact.append(patch.name)
        proc = am(dest, rest, three_way=True)
        if proc.returncode == 0:
            result.applied.extend(p.name for p in patches[i:])
            result.message = "some patches needed offsets or a 3-way merge: export to refresh them"
            break
        done = int(git(dest, "rev-list", "--count", f"{BASE_TAG}..HEAD").stdout)
        result.stopped_at = patches[done].name if done < len(patches) else patch.name
        result.applied = [p.name for p in patches[:done]]
        result.message = (
            f"git am stopped at {result.stopped_at} with conflicts in {dest}.\n"
            f"  resolve them (grep -rn '<<<<<<<' {dest}), `git add` the files, `git am --continue` "
            "(repeat), then export."
        )
        break
    return result


def _check_exportable(repo: Path) -> None:
    gitdir = repo / ".git"
    for marker, what in (("rebase-apply", "git am/rebase"), ("rebase-merge", "git rebase"),
                         ("CHERRY_PICK_HEAD", "git cherry-pick"), ("MERGE_HEAD", "git merge"),
                         ("sequencer", "git cherry-pick sequence")):  # fmt: skip
        if (gitdir / marker).exists():
            raise WorktreeError(f"{repo}: a {what} is in progress; finish it (or abort it) before exporting")
    dirty = git(repo, "status", "--porcelain").stdout.strip()
    if dirty:
        lines = dirty.splitlines()
        shown = "\n  ".join(lines[:10]) + ("\n  …" if len(lines) > 10 else "")
        raise WorktreeError(f"{repo} has uncommitted changes; commit them (one commit per patch) first:\n  {shown}")
    if git(repo, "merge-base", "--is-ancestor", BASE_TAG, "HEAD", check=False).returncode != 0:
        raise WorktreeError(f"{repo}: HEAD does not descend from {BASE_TAG}; rebase your commits onto it")
    if git(repo, "rev-list", "--merges", f"{BASE_TAG}..HEAD").stdout.strip():
        raise WorktreeError(f"{repo}: merge commits since {BASE_TAG}; the series must be linear")


def format_patches(repo: Path, out: Path) -> list[Path]:
    """The canonical content: one file per commit since gp-base (export then names them, see patch_names)."""
    git(repo, *CANONICAL_FORMAT, "-o", str(out), f"{BASE_TAG}..HEAD")
    return sorted(out.glob("*.patch"))


def slug(subject: str) -> str:
    """Lower-case file-name slug of a subject: what STYLE.md asks patch names to look like."""
    text = re.sub(r"[^a-z0-9]+", "-", subject.lower()).strip("-")
    return text[:52].rstrip("-") or "patch"


def patch_names(new: list[Path], patches_dir: Path, old_names: list[str]) -> list[str]:
    """NNNN-<slug>.patch in series order. A patch whose Subject matches a patch of the old series keeps that
    patch's slug (only the number follows its position), so authors' chosen names survive a round trip."""
    by_subject: dict[str, list[str]] = {}
    for name in old_names:
        if (patches_dir / name).is_file():
            by_subject.setdefault(read_patch(patches_dir / name).header.subject, []).append(name)
    names = []
    for index, path in enumerate(new, start=1):
        subject = read_patch(path).header.subject
        reuse = by_subject.get(subject)
        if reuse:
            old = reuse.pop(0)
            m = NUMBERED_RE.match(old)
            names.append(f"{index:04d}-{old[5:]}" if m else old)
        else:
            names.append(f"{index:04d}-{slug(subject)}.patch")
    return names


def export(repo: Path, patches_dir: Path, *, check: bool = False) -> ExportResult:
    """Write the commits since gp-base to patches_dir (series + NNNN-slug.patch), or with check=True only
    compare. Stale *.patch files are removed; the series file's leading comment block is kept."""
    _check_exportable(repo)
    result = ExportResult()
    with tempfile.TemporaryDirectory(prefix="gptools-export-") as tmp:
        new = format_patches(repo, Path(tmp))
        for path in new:
            for finding in lint_patch(read_patch(path)):
                if "conflict marker" in finding.what:
                    raise WorktreeError(f"{finding}: resolve the conflict in the commit before exporting")
        old_series = read_series(patches_dir)
        names = patch_names(new, patches_dir, old_series.names)
        for path, name in zip(new, names, strict=True):
            target = patches_dir / name
            if not target.exists():
                result.added.append(name)
            elif target.read_bytes() != path.read_bytes():
                result.changed.append(name)
            else:
                result.unchanged.append(name)
        result.removed = sorted(p.name for p in patches_dir.glob("*.patch") if p.name not in names)
        result.series_changed = old_series.names != names or not old_series.exists
        if check:
            return result
        patches_dir.mkdir(parents=True, exist_ok=True)
        for name in result.removed:
            (patches_dir / name).unlink()
        for path, name in zip(new, names, strict=True):
            if name in result.added or name in result.changed:
                shutil.copyfile(path, patches_dir / name)
        if result.series_changed:
            write_series(patches_dir, names, old_series.preamble)
    result.findings = [str(f) for f in lint(patches_dir)]
    return result


# ---------------------------------------------------------------------------------------------------- CLI


def default_dir(engine: str) -> Path:
    from gpdist import REPO_ROOT

    return REPO_ROOT / ".work" / "edit" / engine


def _cmd_edit(args: argparse.Namespace) -> int:
    from gpdist import pins
    from gpdist.unpack import upstream_tree
    from gptools.series import patches_dir_for

    if args.engine == "all":
        print("gptools edit: pick one engine (--engine vllm|sglang|deep_ep)", file=sys.stderr)
        return 2
    loaded = pins.load()
    pin = loaded.engine(args.engine)
    pdir = patches_dir_for(args.engine, args.patches_dir)
    dest = Path(args.dir) if args.dir else default_dir(args.engine)
    meta = WorktreeMeta(args.engine, pin.project, pin.version, str(pdir.resolve()))
    print(f"edit: preparing pristine upstream {pin.project} {pin.version}", file=sys.stderr)
    tree = upstream_tree(pin)
    try:
        result = materialize(dest, tree, pdir, meta, force=args.force)
    except WorktreeError as exc:
        print(f"gptools edit: {exc}", file=sys.stderr)
        return 1
    print(f"work tree: {dest} ({len(result.applied)} patch commits on {BASE_TAG})")
    if result.message:
        print(result.message)
    print(f"edit with git (one commit per patch; `git rebase -i {BASE_TAG}` to change one), then:")
    print(
        f"  make export ENGINE={args.engine}" + (f"   # or: python -m gptools export --dir {dest}" if args.dir else "")
    )
    return 1 if result.stopped_at else 0


def _cmd_export(args: argparse.Namespace) -> int:
    from gptools.series import patches_dir_for

    if args.dir:
        repo = Path(args.dir)
    elif args.engine and args.engine != "all":
        repo = default_dir(args.engine)
    else:
        print("gptools export: give --engine or --dir", file=sys.stderr)
        return 2
    try:
        meta = read_meta(repo)
        pdir = Path(args.patches_dir) if args.patches_dir else Path(meta.patches_dir)
        if args.engine not in (None, "all", meta.engine):
            print(f"gptools export: {repo} was made for {meta.engine}, not {args.engine}", file=sys.stderr)
            return 2
        if not args.patches_dir and not pdir.is_dir():
            pdir = patches_dir_for(meta.engine, None)
        print(f"export: {repo} ({BASE_TAG}..HEAD) -> {pdir}", file=sys.stderr)
        result = export(repo, pdir, check=args.check)
    except WorktreeError as exc:
        print(f"gptools export: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(asdict(result), indent=2))
    else:
        for label, names in (("added", result.added), ("changed", result.changed), ("removed", result.removed)):
            for name in names:
                print(f"{label:9} {name}")
        print(
            f"{len(result.unchanged)} unchanged, {len(result.added)} added, {len(result.changed)} changed, "
            f"{len(result.removed)} removed{' (check only: nothing written)' if args.check else ''}"
        )
        for finding in result.findings:
            print(f"lint: {finding}")
    if args.check and result.modified:
        return 1
    return 1 if result.findings else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "edit",
        help="materialize upstream + series as a git work tree",
        description="Create a git work tree (default .work/edit/<engine>): the pinned upstream's text files as "
        f"the base commit (tag {BASE_TAG}) and one commit per patch. Edit with git, then `gptools export`.",
    )
    p.add_argument("--engine", required=True, help="vllm, sglang or deep_ep (build/pins.toml)")
    p.add_argument("--dir", help="where to create the work tree (default .work/edit/<engine>)")
    p.add_argument("--patches-dir", help="series folder to read (default patches/<engine>/)")
    p.add_argument("--force", action="store_true", help="replace an existing work tree (its edits are lost)")
    p.set_defaults(func=_cmd_edit)

    p = subparsers.add_parser(
        "export",
        help="write the work tree's commits back to patches/<engine>/",
        description=f"Write every commit of the work tree since {BASE_TAG} as a canonical git-format patch "
        "and rewrite the series. Exporting an unmodified tree changes nothing. Exit 1 on lint findings.",
    )
    p.add_argument("--engine", help="engine whose default work tree (.work/edit/<engine>) to export")
    p.add_argument("--dir", help="the work tree to export (e.g. .work/rebase/vllm-0.33.0/tree)")
    p.add_argument("--patches-dir", help="write here instead of the folder the tree was made from")
    p.add_argument("--check", action="store_true", help="only report what would change; exit 1 if anything would")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_export)
