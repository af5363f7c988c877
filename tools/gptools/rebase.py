"""Rebase the series onto a new upstream release and report, patch by patch and hunk by hunk, what it takes.

How: one git repository under .work/rebase/<engine>-<version>/tree holds the OLD pinned upstream (tag
`gp-old-base`) with the series replayed on it (branch `series`), and the NEW upstream committed on top of the old
one (tag `gp-base`), so git knows the common base for 3-way merges. Each patch is then

  1. classified against new upstream + the patches before it (GNU patch dry run: exact / offset / fuzz /
     failed per hunk), giving clean / fuzzy / conflict, and
  2. cherry-picked (a 3-way merge with the old upstream as base) to see whether git can carry it.

Finally the series is cherry-picked onto `gp-base` on branch `rebased`; git stops at the first conflict and
leaves the markers in the tree, ready to be resolved (`git cherry-pick --continue` carries on with the rest) and
exported (`make rebase ENGINE=... VERSION=... FINISH=1`). The upstream contract (patches/<engine>/hooks.toml: every
function, class, attribute and module name the patches and the glue rely on) is checked against the new release; the
report names each declared name it removed or renamed (with the names new in that release that look like it).
build/pins.toml is updated only when every patch is clean and every declared name still matches.
"""

from __future__ import annotations

import argparse
import datetime as dt
import difflib
import json
import re
import shlex
import shutil
import socket
import sys
import tomllib
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpdist import REPO_ROOT
from gpdist import pins as pins_mod
from gptools.apply import CLEAN, CONFLICT, FUZZY, HunkResult, classify_patch
from gptools.series import Patch, load_series
from gptools.worktree import (
    BASE_TAG,
    WorktreeMeta,
    am,
    commit_tree_state,
    copy_text_files,
    git,
    init_repo,
    write_meta,
)

OLD_BASE_TAG = "gp-old-base"
WHEEL_RE = re.compile(
    r"^(?P<name>[^-]+)-(?P<version>[^-]+)(?:-\d[^-]*)?-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$"
)


class RebaseError(RuntimeError):
    """The rebase cannot start (no matching wheel, series broken on the old pin, ...)."""


@dataclass
class PatchOutcome:
    """One patch's fate on the new upstream: its classification plus what the 3-way merge made of it."""

    name: str
    subject: str
    status: str
    hunks: list[HunkResult] = field(default_factory=list)
    merge: str = ""
    conflict_files: list[str] = field(default_factory=list)
    note: str = ""


@dataclass
class NewWheel:
    filename: str
    path: Path
    sha256: str
    size: int


@dataclass
class RebaseReport:
    engine: str
    project: str
    old_version: str
    new_version: str
    wheel: str
    sha256: str
    wheel_size: int
    generated: str
    host: str
    patches: list[PatchOutcome] = field(default_factory=list)
    worktree: str = ""
    stopped_at: str = ""
    conflict_markers: list[str] = field(default_factory=list)
    pins_updated: bool = False
    pins_path: str = ""
    pins_note: str = ""
    hook_findings: list[str] = field(default_factory=list)  # declared upstream names that changed, one line each
    contract: list[dict] = field(default_factory=list)  # the same, structured (gptools.hooks.Finding fields)
    work_root: str = ""  # the --work-root given (empty: the default), so the finish command can name it

    def count(self, status: str) -> int:
        return sum(1 for p in self.patches if p.status == status)

    @property
    def clean(self) -> bool:
        return all(p.status == CLEAN for p in self.patches)

    @property
    def repinnable(self) -> bool:
        """Re-pin only when the series applies cleanly AND every declared upstream name is where we expect it."""
        return self.clean and not self.hook_findings

    def finish_command(self) -> str:
        """The `make` form of `gptools rebase --finish`: it runs as written from the repository root, where the
        Makefile provides .venv and PYTHONPATH (a bare `python -m gptools` does not find the build tools)."""
        cmd = f"make rebase ENGINE={self.engine} VERSION={self.new_version} FINISH=1"
        extra = [f"--work-root {shlex.quote(self.work_root)}"] if self.work_root else []
        if self.pins_path and Path(self.pins_path).resolve() != pins_mod.PINS_PATH.resolve():
            extra.append(f"--pins {shlex.quote(self.pins_path)}")
        return cmd + (f' REBASE_ARGS="{" ".join(extra)}"' if extra else "")

    def to_json(self) -> dict:
        data = asdict(self)
        data["counts"] = {s: self.count(s) for s in (CLEAN, FUZZY, CONFLICT)}
        return data

    def markdown(self) -> str:
        n = len(self.patches)
        bad = [p for p in self.patches if p.status != CLEAN]
        if not bad:
            first = f"all {n} patches apply cleanly to {self.project} {self.new_version}"
            if self.hook_findings:
                first += f", but {len(self.hook_findings)} declared upstream name(s) changed"
        else:
            first = f"{len(bad)} of {n} patches need work on {self.project} {self.new_version}: " + ", ".join(
                f"{p.name} ({p.status})" for p in bad
            )
        out = [
            first,
            "",
            f"- date: {self.generated}",
            f"- host: {self.host}",
            f"- engine: {self.engine}: {self.project} {self.old_version} -> {self.new_version}",
            f"- new wheel: {self.wheel} (sha256 {self.sha256})",
            f"- counts: {self.count(CLEAN)} clean, {self.count(FUZZY)} fuzzy, {self.count(CONFLICT)} conflicting",
            f"- work tree: {self.worktree}",
            f"- pins: {'updated' if self.pins_updated else 'NOT updated'} ({self.pins_path}): {self.pins_note}",
            f"- upstream contract (hooks.toml): {len(self.hook_findings)} declared name(s) changed"
            if self.hook_findings
            else "- upstream contract (hooks.toml): every declared name matches",
            "",
            "| # | patch | status | hunks not exact | 3-way merge |",
            "|---|---|---|---|---|",
        ]
        for i, p in enumerate(self.patches, 1):
            inexact = sum(1 for h in p.hunks if h.status != "exact")
            out.append(f"| {i} | {p.name} | {p.status} | {inexact}/{len(p.hunks)} | {p.merge} |")
        details = [p for p in self.patches if p.status != CLEAN or p.note]
        if details:
            out += ["", "## Per hunk"]
            for p in details:
                out += ["", f"### {p.name}: {p.status}", f"{p.subject}", ""]
                out += [f"- {h.describe()}" for h in p.hunks if h.status != "exact"]
                if p.conflict_files:
                    out.append(f"- 3-way merge left conflicts in: {', '.join(p.conflict_files)}")
                if p.note:
                    out.append(f"- note: {p.note}")
        if self.hook_findings:
            out += ["", f"## Declared upstream names that changed (patches/{self.engine}/hooks.toml)", ""]
            if self.contract:
                out += ["| declared | kind | change | maybe renamed to |", "|---|---|---|---|"]
                for c in self.contract:
                    renamed = ", ".join(f"`{r}`" for r in c.get("renamed_to", ())) or "-"
                    out.append(f"| `{c['declared']}` | {c['kind']} | {c['change']} | {renamed} |")
                out.append("")
            out += [f"- {f}" for f in self.hook_findings]
        out += ["", "## Next steps", ""]
        finish = f"`{self.finish_command()}`"
        if self.stopped_at:
            out += [
                f"The series is being cherry-picked onto {self.new_version} in `{self.worktree}` (branch `rebased`); "
                f"it stopped at {self.stopped_at} with conflict markers in:",
                "",
                *[f"- `{m}`" for m in self.conflict_markers],
                "",
                "Resolve them, `git add` the files, `git cherry-pick --continue` (repeat for later conflicts), then "
                f"run {finish} from the repository root to export the refreshed patches, check them against the new "
                "upstream and re-pin.",
            ]
        elif not self.clean:
            out.append(
                f"Every patch was carried onto {self.new_version} in `{self.worktree}` (branch `rebased`); review it, "
                f"then {finish} (from the repository root) refreshes the patches and re-pins."
            )
        elif self.hook_findings:
            out.append(
                "The series applies cleanly, but declared upstream names changed: update "
                f"patches/{self.engine}/hooks.toml and the glue that uses them (overlays/{self.engine}), then run "
                f"{finish} from the repository root."
            )
        else:
            out.append(
                f"Refresh the patches' index lines with {finish} (from the repository root): it exports the rebased "
                "tree and checks it against the new upstream."
            )
        return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------- new upstream wheel


def parse_wheel_name(filename: str) -> dict[str, str] | None:
    m = WHEEL_RE.match(filename)
    return m.groupdict() if m else None


def pick_wheel(pinned: str, version: str, candidates: list[str]) -> str:
    """The new release's wheel with the pinned one's python and ABI tags and CPU architecture (exact platform
    tag preferred; a newer manylinux baseline is accepted)."""
    old = parse_wheel_name(pinned)
    if old is None:
        raise RebaseError(f"cannot parse the pinned wheel name {pinned}")
    arch = old["plat"].rsplit("_", 2)[-2:] if old["plat"].startswith("manylinux") else [old["plat"]]
    matches = []
    for name in candidates:
        w = parse_wheel_name(name)
        if not w or w["version"] != version or (w["py"], w["abi"]) != (old["py"], old["abi"]):
            continue
        if w["name"].lower() != old["name"].lower():
            continue
        if w["plat"] == old["plat"] or w["plat"].endswith("_".join(arch)):
            matches.append(name)
    if not matches:
        listed = [c for c in candidates if f"-{version}-" in c]
        raise RebaseError(
            f"no wheel for version {version} with tags {old['py']}-{old['abi']}-*{'_'.join(arch)}; "
            f"the index lists: {', '.join(listed) or 'nothing for that version'}"
        )
    exact = [m for m in matches if parse_wheel_name(m)["plat"] == old["plat"]]  # type: ignore[index]
    return (exact or sorted(matches))[0]


def list_index(project: str) -> list[str]:
    from gpdist.fetch import INDEX_URL

    req = urllib.request.Request(f"{INDEX_URL}/{project}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return [f["filename"] for f in json.load(resp).get("files", [])]


def fetch_new_wheel(pin: pins_mod.EnginePin, version: str) -> NewWheel:
    from gpdist.fetch import fetch_unpinned

    print(f"rebase: looking up {pin.project} {version} on the package index", file=sys.stderr)
    filename = pick_wheel(pin.wheel.filename, version, list_index(pin.project))
    print(f"rebase: fetching {filename}", file=sys.stderr)
    path, sha = fetch_unpinned(pin.project, filename)
    return NewWheel(filename, path, sha, path.stat().st_size)


def fetch_other_wheels(pin: pins_mod.EnginePin, version: str) -> list[NewWheel]:
    """The new release's wheels for the pin's other Pythons (deep_ep has one per Python), same tags as pinned; a
    Python the new release lacks is a RebaseError naming it."""
    if not pin.other_wheels:
        return []
    from gpdist.fetch import fetch_unpinned

    listing = list_index(pin.project)
    out = []
    for art in pin.other_wheels:
        filename = pick_wheel(art.filename, version, listing)
        print(f"rebase: fetching {filename}", file=sys.stderr)
        path, sha = fetch_unpinned(pin.project, filename)
        out.append(NewWheel(filename, path, sha, path.stat().st_size))
    return out


def wheel_facts(tree: Path, package: str) -> tuple[str, str]:
    """(commit from <pkg>/_version.py without the leading 'g', torch pin from METADATA), '' when absent."""
    commit = ""
    version_py = tree / package / "_version.py"
    if version_py.is_file():
        m = re.search(r"commit_id\s*=\s*['\"]g?([0-9a-f]{6,40})['\"]", version_py.read_text())
        commit = m.group(1) if m else ""
    torch = ""
    for meta in tree.glob("*.dist-info/METADATA"):
        m = re.search(r"^Requires-Dist: torch\s*==\s*([^\s;,]+)", meta.read_text(errors="replace"), re.MULTILINE)
        torch = m.group(1) if m else ""
    return commit, torch


# ------------------------------------------------------------------------------------------------- pins.toml


def _wheel_table(wheel: NewWheel) -> str:
    return f'{{ filename = "{wheel.filename}", size = {wheel.size}, sha256 = "{wheel.sha256}" }}'


def update_pins_text(
    text: str,
    engine: str,
    *,
    version: str,
    wheel: NewWheel,
    commit: str,
    torch: str,
    other_wheels: list[NewWheel] | None = None,
) -> str:
    """Re-pin one engine in pins.toml by editing its lines (comments elsewhere stay). On a new version the sdist is
    dropped: rebase only knows the wheel, and a stale sdist pin would name the wrong release. On the pinned version
    (a rebase onto the same release, run as a control) the sdist still names that release and stays.
    `other_wheels` (the release's wheels for the other Pythons) replaces a pinned `other_wheels` array; an engine
    that pins other wheels must get them."""
    lines = text.splitlines(keepends=True)
    header = f"[engines.{engine}]"
    try:
        start = next(i for i, ln in enumerate(lines) if ln.strip() == header)
    except StopIteration:
        raise RebaseError(f"pins file has no {header} table") from None
    end = next((i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("[")), len(lines))
    section = lines[start + 1 : end]
    replacements = {
        "version": f'version = "{version}"\n',
        "wheel": f"wheel = {_wheel_table(wheel)}\n",
        "commit_wheel": f'commit_wheel = "{commit}"\n',
    }
    if torch:
        replacements["requires_torch"] = f'requires_torch = "{torch}"\n'
    if other_wheels is not None:
        replacements["other_wheels"] = "other_wheels = [\n" + "".join(f"  {_wheel_table(w)},\n" for w in other_wheels)
        replacements["other_wheels"] += "]\n"
    same_release = tomllib.loads(text).get("engines", {}).get(engine, {}).get("version") == version
    out: list[str] = []
    found = set()
    skip_to_bracket = False
    for line in section:
        if skip_to_bracket:  # the rest of a multi-line array being replaced
            skip_to_bracket = not line.strip().startswith("]")
            continue
        key = line.split("=", 1)[0].strip() if "=" in line and not line.lstrip().startswith("#") else ""
        if key == "other_wheels" and key in replacements:
            value = line.split("=", 1)[1].split("#", 1)[0].strip()
            skip_to_bracket = value.startswith("[") and not value.endswith("]")
        if key in ("sdist", "commit_sdist") and not same_release:
            while out and out[-1].lstrip().startswith("#"):
                out.pop()  # the comment described the dropped sdist
            if key == "sdist":
                out.append(f"# No sdist pinned for {version}: `gptools rebase` re-pins the wheel only.\n")
            continue
        if key in replacements:
            out.append(replacements[key])
            found.add(key)
            continue
        out.append(line)
    missing = {"version", "wheel"} - found
    if other_wheels is not None and "other_wheels" not in found:
        missing.add("other_wheels")
    if missing:
        raise RebaseError(f"{header} lacks {', '.join(sorted(missing))}; edit pins.toml by hand")
    if "commit_wheel" not in found:
        while out and not out[-1].strip():
            out.pop()
        out.append(replacements["commit_wheel"])
        out.append("\n")
    return "".join(lines[: start + 1] + out + lines[end:])


def update_pins(
    path: Path,
    engine: str,
    *,
    version: str,
    wheel: NewWheel,
    commit: str,
    torch: str,
    other_wheels: list[NewWheel] | None = None,
) -> None:
    """Edit, re-load through gpdist.pins to prove the result is valid and says what we meant, then replace."""
    if other_wheels is None and pins_mod.load(path).engine(engine).other_wheels:
        raise RebaseError(f"{engine} pins wheels for other Pythons too: re-pin them with the new release")
    new_text = update_pins_text(
        path.read_text(), engine, version=version, wheel=wheel, commit=commit, torch=torch, other_wheels=other_wheels
    )
    tmp = path.with_name(path.name + ".rebase.tmp")
    tmp.write_text(new_text)
    try:
        pin = pins_mod.load(tmp).engine(engine)
        others = [(w.filename, w.sha256, w.size) for w in other_wheels or []]
        pinned_others = [(a.filename, a.sha256, a.size) for a in pin.other_wheels]
        if (pin.version, pin.wheel.filename, pin.wheel.sha256, pin.wheel.size, pin.commit_wheel) != (
            version, wheel.filename, wheel.sha256, wheel.size, commit,
        ) or (other_wheels is not None and pinned_others != others):  # fmt: skip
            raise RebaseError(f"re-loading the edited pins gave {pin}; not writing {path}")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------------- rebase


def _set_aside(work: Path) -> Path:
    """A previous attempt may hold resolved conflicts: never delete it, rename it to the first free .N name."""
    n = 1
    while (keep := work.with_name(f"{work.name}.{n}")).exists():
        n += 1
    work.rename(keep)
    return keep


def _replace_tree(repo: Path, src: Path) -> int:
    for child in repo.iterdir():
        if child.name == ".git":
            continue
        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    return copy_text_files(src, repo)


def _conflict_files(repo: Path) -> list[str]:
    return [f for f in git(repo, "diff", "--name-only", "--diff-filter=U").stdout.splitlines() if f]


def conflict_spans(marked: str, ours: str) -> list[tuple[int, int]]:
    """The conflict blocks git left in a file (`marked`), as 1-based inclusive line ranges of the merge's "ours"
    side (`ours`: new upstream plus the earlier patches), the file GNU patch classified the hunks against, so its
    hunk line numbers compare with these. Outside the blocks the marked file also holds the other side's cleanly
    merged lines, so each block is located by the nearest lines around it that ours has too. A block whose ours
    side is empty spans the two lines around its insertion point."""
    projection: list[str] = []  # the marked file with each block reduced to its ours side
    blocks: list[tuple[int, int]] = []  # each block's ours side, as a slice of `projection`
    state = ""
    start = 0
    for line in marked.splitlines():
        if not state and line.startswith("<<<<<<< "):
            state, start = "ours", len(projection)
        elif state in ("ours", "base") and line.rstrip() == "=======":
            state = "theirs"
        elif state == "ours" and line.startswith("||||||| "):
            state = "base"
        elif state == "theirs" and line.startswith(">>>>>>> "):
            blocks.append((start, len(projection)))
            state = ""
        elif state in ("", "ours"):
            projection.append(line)
    ours_lines = ours.splitlines()
    to_ours: dict[int, int] = {}
    matcher = difflib.SequenceMatcher(None, ours_lines, projection, autojunk=False)
    for i, j, n in matcher.get_matching_blocks():
        to_ours.update({j + k: i + k + 1 for k in range(n)})
    spans = []
    for first, end in blocks:
        before = next((to_ours[j] for j in range(first - 1, -1, -1) if j in to_ours), 0)
        after = next((to_ours[j] for j in range(end, len(projection)) if j in to_ours), len(ours_lines) + 1)
        spans.append((before + 1, after - 1) if after - 1 >= before + 1 else (before, after))
    return spans


def mark_conflicting_hunks(repo: Path, patch: Patch, hunks: list[HunkResult], files: list[str]) -> list[HunkResult]:
    """A hunk GNU patch places (exactly, with offset or with fuzz) but whose lines the 3-way merge left in conflict
    is a conflict, not fuzz: re-label it so the report says so. Returns the hunks re-labelled."""
    lengths = {(fd.path, h.index): h.old_len for fd in patch.files for h in fd.hunks}
    spans = {}
    for f in files:
        ours = git(repo, "show", f"HEAD:{f}", check=False)
        if (repo / f).is_file() and ours.returncode == 0:
            spans[f] = conflict_spans((repo / f).read_text(errors="replace"), ours.stdout)
    changed = []
    for h in hunks:
        if h.status == "failed" or h.line is None or not spans.get(h.file):
            continue
        first, last = h.line, h.line + max(lengths.get((h.file, h.index), 1), 1) - 1
        hit = [(a, b) for a, b in spans[h.file] if a <= last and first <= b]
        if not hit:
            continue
        how = ", ".join([f"offset {h.offset:+d} lines"] * bool(h.offset) + [f"fuzz {h.fuzz}"] * bool(h.fuzz))
        where = ", ".join(f"{a}-{b}" for a, b in hit)
        h.message = f"GNU patch alone would apply it at line {h.line} ({how or 'exactly'}), but the 3-way merge "
        h.message += f"conflicts at lines {where}"
        h.status = CONFLICT
        changed.append(h)
    return changed


def _marker_files(repo: Path) -> list[str]:
    proc = git(repo, "grep", "-l", "-E", "^(<{7}|>{7}) ", check=False)
    return [f for f in proc.stdout.splitlines() if f]


def rebase(
    engine: str,
    version: str,
    *,
    pins_path: Path = pins_mod.PINS_PATH,
    work_root: Path | None = None,
    patches_dir: Path | None = None,
    old_tree: Path | None = None,
    new_wheel: NewWheel | None = None,
    update: bool = True,
) -> RebaseReport:
    """Replay the series onto `version`, classify every patch, leave an editable tree, write report.md/.json,
    and re-pin only if every patch is clean and every declared upstream name still matches.
    Injectable paths keep tests away from the real pins and downloads."""
    from gpdist.unpack import unpack_wheel, upstream_tree

    pins = pins_mod.load(pins_path)
    pin = pins.engine(engine)
    patches_dir = patches_dir or pin.patches_dir
    work = (work_root or REPO_ROOT / ".work" / "rebase") / f"{engine}-{version}"
    say = lambda msg: print(f"rebase: {msg}", file=sys.stderr)  # noqa: E731
    if old_tree is None:
        say(f"preparing pristine {pin.project} {pin.version}")
        old_tree = upstream_tree(pin)
    new_wheel = new_wheel or fetch_new_wheel(pin, version)
    if work.exists():
        keep = _set_aside(work)
        say(f"kept the previous attempt (and any work in it) as {keep}")
    work.mkdir(parents=True)
    say(f"unpacking {new_wheel.filename}")
    new_tree = unpack_wheel(new_wheel.path, work / "upstream-new")
    commit, torch = wheel_facts(new_tree, pin.project.replace("-", "_"))

    repo = work / "tree"
    init_repo(repo)
    say(f"committing the text files of {pin.project} {pin.version} (old base)")
    copy_text_files(old_tree, repo)
    commit_tree_state(repo, f"upstream {pin.project} {pin.version}", "2000-01-01T00:00:00Z")
    git(repo, "tag", OLD_BASE_TAG)
    patches = load_series(patches_dir)
    for patch in patches:
        cls = classify_patch(repo, patch)
        if cls.status != CLEAN or am(repo, [patch.path]).returncode != 0:
            detail = "; ".join(h.describe() for h in cls.not_exact)
            raise RebaseError(
                f"{patch.name} does not apply exactly to the pinned {pin.project} {pin.version} ({detail}); "
                f"fix the series first (make edit ENGINE={engine})"
            )
    git(repo, "branch", "-f", "series", "HEAD")
    say(f"replayed {len(patches)} patch(es) on the old base; committing {pin.project} {version} on top of it")
    git(repo, "checkout", "-q", "--detach", OLD_BASE_TAG)
    _replace_tree(repo, new_tree)
    commit_tree_state(repo, f"upstream {pin.project} {version}", "2000-01-02T00:00:00Z")
    git(repo, "tag", BASE_TAG)
    commits = git(repo, "rev-list", "--reverse", f"{OLD_BASE_TAG}..series").stdout.split()

    report = RebaseReport(
        engine=engine,
        project=pin.project,
        old_version=pin.version,
        new_version=version,
        wheel=new_wheel.filename,
        sha256=new_wheel.sha256,
        wheel_size=new_wheel.size,
        generated=dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        host=socket.gethostname(),
        worktree=str(repo),
        pins_path=str(pins_path),
        work_root=str(work_root) if work_root is not None else "",
    )
    left_out: list[str] = []
    for patch, sha in zip(patches, commits, strict=True):
        say(f"classifying {patch.name}")
        cls = classify_patch(repo, patch)
        outcome = PatchOutcome(patch.name, patch.header.subject, cls.status, cls.hunks)
        if left_out:
            outcome.note = f"classified without the conflicting {', '.join(left_out)}"
        pick = git(repo, "cherry-pick", "--allow-empty", "--keep-redundant-commits", sha, check=False)
        if pick.returncode == 0:
            empty = not git(repo, "diff", "--name-only", "HEAD~1", "HEAD").stdout.strip()
            if empty:
                outcome.merge = "empty after merge: the change is already upstream (drop the patch?)"
                outcome.status = CONFLICT if cls.status == CLEAN else cls.status
            elif cls.status == CONFLICT:
                outcome.merge = "resolved automatically (refresh the patch)"
            else:
                outcome.merge = "applied"
        else:
            outcome.conflict_files = _conflict_files(repo)
            outcome.merge = f"conflicts in {len(outcome.conflict_files)} file(s)"
            outcome.status = CONFLICT
            relabelled = mark_conflicting_hunks(repo, patch, outcome.hunks, outcome.conflict_files)
            if cls.status != CONFLICT:
                outcome.note = (outcome.note + "; " if outcome.note else "") + (
                    f"GNU patch alone would apply every hunk ({cls.status}), but the 3-way merge conflicts"
                    + (f" in hunk(s) {', '.join(f'{h.file} #{h.index}' for h in relabelled)}" if relabelled else "")
                )
            git(repo, "cherry-pick", "--abort", check=False)
            git(repo, "reset", "-q", "--hard", check=False)
            left_out.append(patch.name)
        report.patches.append(outcome)

    say("carrying the series onto the new base (branch `rebased`)")
    git(repo, "checkout", "-q", "-B", "rebased", BASE_TAG)
    write_meta(repo, WorktreeMeta(engine, pin.project, version, str(patches_dir.resolve()), BASE_TAG, pin.version))
    if commits:
        pick = git(repo, "cherry-pick", "--allow-empty", "--keep-redundant-commits", *commits, check=False)
        if pick.returncode != 0:
            done = int(git(repo, "rev-list", "--count", f"{BASE_TAG}..HEAD").stdout)
            report.stopped_at = patches[min(done, len(patches) - 1)].name
            report.conflict_markers = _marker_files(repo) or _conflict_files(repo)

    from gptools.hooks import HOOKS_FILE, check_contract, load_contract

    hooks_file = patches_dir / HOOKS_FILE
    if hooks_file.is_file():
        say(f"checking the declared upstream names ({hooks_file.name}) in {pin.project} {version}")
        changes = check_contract(new_tree, load_contract(hooks_file), old_tree)
        report.hook_findings = [c.message for c in changes]
        report.contract = [{**asdict(c), "declared": c.declared} for c in changes]
    if report.repinnable and update:
        try:
            others = fetch_other_wheels(pin, version) if pin.other_wheels else None
        except RebaseError as exc:
            others, report.pins_note = None, f"left at the old pin: {exc}"
        if others is not None or not pin.other_wheels:
            say(f"every patch is clean: re-pinning {engine} to {version} in {pins_path}")
            update_pins(
                pins_path, engine, version=version, wheel=new_wheel, commit=commit, torch=torch, other_wheels=others
            )
            report.pins_updated = True
            report.pins_note = f"{engine} now pins {', '.join(w.filename for w in [new_wheel, *(others or [])])}"
    elif report.repinnable:
        report.pins_note = "every patch is clean; pins left alone as asked (--no-update-pins)"
    elif report.clean:
        report.pins_note = "every patch is clean, but declared upstream names changed: fix hooks.toml and the glue"
    else:
        report.pins_note = "left at the old pin because not every patch is clean"
    (work / "report.md").write_text(report.markdown())
    (work / "report.json").write_text(json.dumps(report.to_json(), indent=2, default=str) + "\n")
    return report


def finish(
    engine: str,
    version: str,
    *,
    pins_path: Path = pins_mod.PINS_PATH,
    work_root: Path | None = None,
    patches_dir: Path | None = None,
) -> list[str]:
    """After the conflicts are resolved in the rebase tree: export the refreshed series, prove it applies with
    zero fuzz to the new upstream, and only then re-pin. Returns the exported patch names."""
    from gptools.apply import PatchApplyError, apply_series
    from gptools.worktree import WorktreeError, export, read_meta

    work = (work_root or REPO_ROOT / ".work" / "rebase") / f"{engine}-{version}"
    report_path = work / "report.json"
    if not report_path.is_file():
        raise RebaseError(f"no rebase report in {work}; run `make rebase ENGINE={engine} VERSION={version}` first")
    data = json.loads(report_path.read_text())
    repo = work / "tree"
    try:
        meta = read_meta(repo)
        pdir = patches_dir or Path(meta.patches_dir)
        # Export into a scratch copy first: the real series changes only once it is proven on the new upstream.
        trial = work / "series-trial"
        shutil.rmtree(trial, ignore_errors=True)
        shutil.copytree(pdir, trial) if pdir.is_dir() else trial.mkdir()
        result = export(repo, trial)
        if result.findings:
            raise RebaseError("the exported series has lint findings:\n  " + "\n  ".join(result.findings))
        expected = [p["subject"] for p in data["patches"]]
        exported = [patch.header.subject for patch in load_series(trial)]
        if exported != expected:
            missing = [subject for subject in expected if subject not in exported]
            raise RebaseError(
                f"the rebased tree holds {len(exported)} patch(es), the series had {len(expected)}"
                + (f"; missing: {', '.join(missing)}" if missing else "")
                + ". Was a cherry-pick aborted or skipped? Finish it (or drop a patch from the series on purpose "
                "and rebase again); nothing was exported or re-pinned."
            )
        print(f"rebase: checking the refreshed series against {engine} {version} (zero fuzz)", file=sys.stderr)
        applied = apply_series(work / "upstream-new", trial, dry_run=True)
        from gptools.hooks import HOOKS_FILE, check_hooks

        if (pdir / HOOKS_FILE).is_file():
            moved = check_hooks(work / "upstream-new", pdir / HOOKS_FILE)
            if moved:
                raise RebaseError(
                    f"declared upstream names changed in {engine} {version}; update {pdir / HOOKS_FILE} and the "
                    "glue that uses them, then --finish again:\n  " + "\n  ".join(moved)
                )
        print(f"rebase: exporting {repo} to {pdir}", file=sys.stderr)
        export(repo, pdir)
        shutil.rmtree(trial, ignore_errors=True)
    except (WorktreeError, PatchApplyError) as exc:
        raise RebaseError(str(exc)) from exc
    new_tree = work / "upstream-new"
    pin = pins_mod.load(pins_path).engine(engine)
    commit, torch = wheel_facts(new_tree, pin.project.replace("-", "_"))
    wheel = NewWheel(data["wheel"], Path(data["wheel"]), data["sha256"], int(data["wheel_size"]))
    others = fetch_other_wheels(pin, version) if pin.other_wheels else None
    update_pins(pins_path, engine, version=version, wheel=wheel, commit=commit, torch=torch, other_wheels=others)
    print(f"rebase: {engine} re-pinned to {version} in {pins_path}", file=sys.stderr)
    return [r.name for r in applied]


# ---------------------------------------------------------------------------------------------------- CLI


def _cmd_rebase(args: argparse.Namespace) -> int:
    if args.engine == "all":
        print(f"gptools rebase: pick one engine (--engine {'|'.join(pins_mod.engine_names())})", file=sys.stderr)
        return 2
    pins_path = Path(args.pins) if args.pins else pins_mod.PINS_PATH
    if args.finish:
        try:
            names = finish(
                args.engine,
                args.version,
                pins_path=pins_path,
                work_root=Path(args.work_root) if args.work_root else None,
                patches_dir=Path(args.patches_dir) if args.patches_dir else None,
            )
        except (RebaseError, OSError) as exc:
            print(f"gptools rebase --finish: {exc}", file=sys.stderr)
            return 1
        print(f"{len(names)} patch(es) refreshed and applying exactly to {args.version}; pins updated")
        return 0
    wheel = None
    if args.wheel:
        from gpdist.fetch import sha256_file

        path = Path(args.wheel)
        wheel = NewWheel(path.name, path, sha256_file(path), path.stat().st_size)
    try:
        report = rebase(
            args.engine,
            args.version,
            pins_path=pins_path,
            work_root=Path(args.work_root) if args.work_root else None,
            patches_dir=Path(args.patches_dir) if args.patches_dir else None,
            new_wheel=wheel,
            update=not args.no_update_pins,
        )
    except (RebaseError, OSError) as exc:
        print(f"gptools rebase: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report.to_json(), indent=2, default=str))
    else:
        print(report.markdown())
        print(f"report: {Path(report.worktree).parent / 'report.md'} (and report.json)")
    return 0 if report.repinnable else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "rebase",
        help="re-apply the series on a new upstream release and report",
        description="Fetch the new upstream wheel (same python/ABI/platform tags as the pinned one), replay the "
        "series with 3-way merges, classify each patch clean / fuzzy / conflict with per-hunk detail, leave an "
        "editable tree in .work/rebase/<engine>-<version>/tree and write report.md/.json next to it. "
        "build/pins.toml is updated only when every patch is clean and every name hooks.toml declares matches. "
        "Exit 1 when something needs work.",
    )
    p.add_argument("--engine", required=True, help=f"one of {', '.join(pins_mod.engine_names())}")
    p.add_argument("--version", required=True, help="the new upstream version, e.g. 0.33.0")
    p.add_argument("--pins", help=f"pins file to read and update (default {pins_mod.PINS_PATH})")
    p.add_argument("--wheel", help="use this local wheel instead of fetching one from the index")
    p.add_argument("--patches-dir", help="series folder (default patches/<engine>/)")
    p.add_argument("--work-root", help="where <engine>-<version>/ goes (default .work/rebase)")
    p.add_argument("--no-update-pins", action="store_true", help="never touch the pins file, even when clean")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of the Markdown")
    p.add_argument(
        "--finish",
        action="store_true",
        help="after resolving the conflicts in the rebase tree: export the refreshed series, check it applies "
        "exactly to the new upstream, then re-pin",
    )
    p.set_defaults(func=_cmd_rebase)
