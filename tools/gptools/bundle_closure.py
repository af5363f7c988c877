"""Dependency closure for an offline bundle: which wheels must travel so that a target host can import the engines.

The walk starts from the chosen engine wheels' Requires-Dist (plus any `--require NAME==VER`: a package an engine
imports without declaring it), evaluates every marker for the *target* (not for the machine running the bundle),
skips what the target's `pip freeze` already satisfies, and otherwise picks a wheel: a `--prefer NAME==VER` override
first, then a wheel pinned in build/pins.toml, then `pip download` of the newest version that satisfies every
requirement seen so far. Downloaded wheels are recursed into.

It is a greedy, level-by-level walk (no backtracking): when a requirement met later rules out a version already
picked, that is reported as a conflict, never silently ignored. Every decision keeps the requirement(s) that caused
it, so the manifest can say why each wheel is there.
"""

from __future__ import annotations

import contextlib
import email.parser
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from packaging import tags
from packaging.markers import Marker
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version


class ClosureError(RuntimeError):
    """The closure could not be computed (a wheel could not be obtained or read)."""


# --------------------------------------------------------------------------------------------------------------------
# The target host


@dataclass(frozen=True)
class Target:
    """The host the bundle is for: CPython version and glibc decide markers and acceptable wheel tags."""

    python_version: str = "3.12"
    python_full_version: str = "3.12.3"
    glibc: str = "2.39"
    machine: str = "x86_64"

    @property
    def py(self) -> tuple[int, int]:
        major, minor = self.python_version.split(".")[:2]
        return int(major), int(minor)

    def marker_env(self, extra: str = "") -> dict[str, str]:
        return {
            "implementation_name": "cpython",
            "implementation_version": self.python_full_version,
            "os_name": "posix",
            "platform_machine": self.machine,
            "platform_python_implementation": "CPython",
            "platform_release": "",
            "platform_system": "Linux",
            "platform_version": "",
            "python_full_version": self.python_full_version,
            "python_version": "{}.{}".format(*self.py),
            "sys_platform": "linux",
            "extra": extra,
        }

    def platforms(self) -> list[str]:
        """Platform tags the target accepts, newest first (pip matches each --platform exactly)."""
        major, minor = (int(x) for x in self.glibc.split(".")[:2])
        plats = [f"manylinux_{major}_{m}_{self.machine}" for m in range(minor, 4, -1)]
        legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
        for m, name in legacy.items():
            if m <= minor:
                plats.append(f"{name}_{self.machine}")
        return plats

    def supported_tags(self) -> set[tags.Tag]:
        cp = f"cp{self.py[0]}{self.py[1]}"
        plats = self.platforms()
        supported = set(tags.cpython_tags(self.py, abis=[cp], platforms=plats))
        supported |= set(tags.compatible_tags(self.py, interpreter=cp, platforms=plats))
        return supported

    def accepts_wheel(self, filename: str) -> bool:
        _, _, _, wheel_tags = parse_wheel_filename(filename)
        return bool(set(wheel_tags) & self.supported_tags())

    def describe(self) -> str:
        return f"CPython {self.python_full_version}, linux {self.machine}, glibc {self.glibc}"


# --------------------------------------------------------------------------------------------------------------------
# Inputs: the host freeze and wheel metadata

_FREEZE_LINE = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*===?\s*([^\s;#]+)")


def parse_freeze(text: str) -> dict[str, str]:
    """`pip freeze` output -> {canonical name: version}. Editable/URL lines (`-e`, `name @ url`) are kept by name
    with version '' (present, version unknown) so that they still count as installed."""
    installed: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _FREEZE_LINE.match(line)
        if m:
            installed[canonicalize_name(m.group(1))] = m.group(2)
            continue
        if " @ " in line:
            installed[canonicalize_name(line.split(" @ ", 1)[0].strip())] = ""
    return installed


@dataclass(frozen=True)
class WheelMeta:
    name: str  # canonical
    display_name: str
    version: str
    requires: tuple[str, ...]
    requires_python: str


def read_wheel_meta(path: Path) -> WheelMeta:
    """Name, version and Requires-Dist from a wheel's METADATA (no unpacking, no import)."""
    with zipfile.ZipFile(path) as zf:
        candidates = [n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        if len(candidates) != 1:
            raise ClosureError(f"{path.name}: expected one *.dist-info/METADATA, found {len(candidates)}")
        msg = email.parser.Parser().parsestr(zf.read(candidates[0]).decode("utf-8"))
    return WheelMeta(
        name=canonicalize_name(msg["Name"]),
        display_name=msg["Name"],
        version=msg["Version"],
        requires=tuple(msg.get_all("Requires-Dist") or ()),
        requires_python=msg.get("Requires-Python") or "",
    )


# --------------------------------------------------------------------------------------------------------------------
# Decisions


REQUIRE = "--require"  # Reason.by of a requirement given on the command line instead of by a wheel


@dataclass
class Reason:
    """One requirement that asked for a package: who asked, what they asked for, and (for --require) why."""

    by: str  # "vllm 0.26.0+gp.1", "--prefer" or REQUIRE
    requirement: str
    why: str = ""

    def __str__(self) -> str:
        return f"{self.by}: {self.requirement}" + (f" ({self.why})" if self.why else "")


# How a package is provided on the target.
DIST = "dist"  # one of our dist/ wheels
PINNED = "pinned"  # a wheel pinned in build/pins.toml, fetched by sha256
PREFERRED = "preferred"  # a --prefer NAME==VER override, downloaded
DOWNLOADED = "downloaded"  # newest version satisfying the requirements, downloaded
HOST = "host"  # the host's installed version satisfies every requirement
HOST_ACCEPTED = "host-accepted"  # the host's version does not satisfy, but --accept-host says use it anyway
EXCLUDED = "excluded"  # --exclude: not brought, not checked

BUNDLED = (DIST, PINNED, PREFERRED, DOWNLOADED)


@dataclass
class Pick:
    name: str
    version: str
    source: str
    reasons: list[Reason] = field(default_factory=list)
    path: Path | None = None
    note: str = ""
    extras_seen: set[str] = field(default_factory=set)

    @property
    def bundled(self) -> bool:
        return self.source in BUNDLED


@dataclass
class Closure:
    target: Target
    picks: dict[str, Pick]
    conflicts: list[str]
    warnings: list[str]

    def bundled(self) -> list[Pick]:
        return sorted((p for p in self.picks.values() if p.bundled), key=lambda p: p.name)

    def by_source(self, source: str) -> list[Pick]:
        return sorted((p for p in self.picks.values() if p.source == source), key=lambda p: p.name)


# A fetcher turns (name, specifier) into a local wheel file for the target; pip download in real use, a dict in tests.
Fetcher = Callable[[str, SpecifierSet, Target], Path]


@dataclass(frozen=True)
class PinnedWheel:
    """A dependency wheel pinned in build/pins.toml; get() returns a sha256-verified local copy."""

    name: str
    version: str
    get: Callable[[], Path]


def parse_prefer(values: Iterable[str]) -> dict[str, Requirement]:
    """`--prefer NAME==VER` (or any specifier, e.g. `tokenizers<=0.23.0`) -> {canonical name: Requirement}."""
    out: dict[str, Requirement] = {}
    for value in values:
        for line in value.splitlines():
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            try:
                req = Requirement(line)
            except InvalidRequirement as exc:
                raise ValueError(f"--prefer {line!r}: not a requirement ({exc})") from None
            if not req.specifier:
                raise ValueError(f"--prefer {line!r}: give a version, e.g. {req.name}==1.2.3")
            out[canonicalize_name(req.name)] = req
    return out


_REQUIRE = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([A-Za-z0-9][A-Za-z0-9.+!_-]*)\s*(?:=(.*))?$")


def parse_require(values: Iterable[str]) -> dict[str, Reason]:
    """`--require NAME==VER[=WHY]` -> {canonical name: Reason(REQUIRE, "NAME==VER", WHY)}.

    One exact version, so that the bundle is reproducible and a host or pinned version that differs is a conflict
    to settle explicitly rather than a silent choice."""
    out: dict[str, Reason] = {}
    for value in values:
        m = _REQUIRE.match(value)
        try:
            version = Version(m.group(2)) if m else None
        except InvalidVersion:
            version = None
        if m is None or version is None:
            raise ValueError(
                f"--require {value!r}: expected NAME==VERSION[=REASON] with one exact version, "
                "e.g. --require 'dill==0.4.1=imported by sglang/srt/sampling/custom_logit_processor.py'"
            )
        name = canonicalize_name(m.group(1))
        reason = Reason(REQUIRE, f"{m.group(1)}=={version}", (m.group(3) or "").strip())
        if name in out and out[name].requirement != reason.requirement:
            raise ValueError(f"--require {name}: given twice with different versions ({out[name].requirement})")
        out[name] = reason
    return out


def _version_ok(spec: SpecifierSet, version: str) -> bool:
    try:
        return spec.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def resolve(
    roots: list[Path],
    *,
    target: Target,
    host: dict[str, str],
    fetcher: Fetcher,
    local: dict[str, Path] | None = None,
    pinned: Iterable[PinnedWheel] = (),
    prefer: dict[str, Requirement] | None = None,
    exclude: dict[str, str] | None = None,
    accept_host: set[str] | None = None,
    require: dict[str, Reason] | None = None,
    progress: Callable[[str], None] = lambda s: None,
    workers: int = 8,
) -> Closure:
    """Walk the requirements of `roots` (our engine wheels) level by level and decide every package.

    local: wheels from dist/ that can satisfy a requirement by name (graphpersist).
    exclude: {name: reason} never brought nor checked (a declared dependency the target does not need).
    accept_host: names whose host version is used even where it does not satisfy a requirement.
    require: {name: Reason} from parse_require: walked like the engines' own requirements, except that a host or
      pinned version that does not match is a conflict (the engine never declared which versions it works with).
    """
    local = {canonicalize_name(k): v for k, v in (local or {}).items()}
    prefer = prefer or {}
    exclude = {canonicalize_name(k): v for k, v in (exclude or {}).items()}
    accept_host = {canonicalize_name(n) for n in (accept_host or set())}
    pinned_by_name: dict[str, list[PinnedWheel]] = {}
    for p in pinned:
        pinned_by_name.setdefault(canonicalize_name(p.name), []).append(p)

    memo: dict[tuple[str, str], Path] = {}

    def fetch(name: str, spec: SpecifierSet, tgt: Target) -> Path:
        key = (name, str(spec))
        if key not in memo:
            memo[key] = fetcher(name, spec, tgt)
        return memo[key]

    picks: dict[str, Pick] = {}
    conflicts = _Conflicts()
    warnings: list[str] = []
    pending: list[tuple[Requirement, Reason]] = []

    def enqueue(meta: WheelMeta, extras: set[str]) -> None:
        by = f"{meta.display_name} {meta.version}"
        for line in meta.requires:
            req = Requirement(line)
            if req.marker is not None:
                envs = [target.marker_env("")] + [target.marker_env(e) for e in sorted(extras)]
                if not any(req.marker.evaluate(env) for env in envs):
                    continue
            pending.append((req, Reason(by, line)))

    def take_wheel(path: Path, source: str, reasons: list[Reason], extras: set[str], note: str = "") -> Pick:
        meta = read_wheel_meta(path)
        if not target.accepts_wheel(path.name):
            raise ClosureError(f"{path.name} is not installable on the target ({target.describe()})")
        if meta.requires_python and not _version_ok(SpecifierSet(meta.requires_python), target.python_full_version):
            conflicts.other.append(
                f"{meta.display_name} {meta.version} requires Python {meta.requires_python}; "
                f"the target has {target.python_full_version}"
            )
        pick = Pick(meta.name, meta.version, source, list(reasons), path, note, set(extras))
        picks[meta.name] = pick
        enqueue(meta, extras)
        return pick

    for root in roots:
        meta = read_wheel_meta(root)
        take_wheel(root, DIST, [], set(), "engine chosen with --engine")
        progress(f"root {meta.display_name} {meta.version}: {len(meta.requires)} declared requirements")
    for reason in (require or {}).values():
        pending.append((Requirement(reason.requirement), reason))

    level = 0
    while pending:
        level += 1
        batch, pending[:] = list(pending), []
        grouped: dict[str, list[tuple[Requirement, Reason]]] = {}
        for req, reason in batch:
            grouped.setdefault(canonicalize_name(req.name), []).append((req, reason))
        fresh = [n for n in grouped if n not in picks]
        progress(f"level {level}: {len(batch)} requirements, {len(fresh)} new packages")
        _prefetch(fresh, grouped, fetch, host, local, prefer, exclude, accept_host, pinned_by_name, target, workers)
        for name in sorted(grouped):
            reqs = grouped[name]
            reasons = [r for _, r in reqs]
            extras = set().union(*(set(r.extras) for r, _ in reqs))
            if name in picks:
                _recheck(picks[name], reqs, conflicts)
                pick = picks[name]
                pick.reasons.extend(reasons)
                new_extras = extras - pick.extras_seen
                if new_extras and pick.path is not None:
                    pick.extras_seen |= new_extras
                    enqueue(read_wheel_meta(pick.path), new_extras)
                elif new_extras and pick.source in (HOST, HOST_ACCEPTED):
                    warnings.append(f"{name}[{','.join(sorted(new_extras))}]: extras of a host package not checked")
                continue
            spec = SpecifierSet()
            for req, _ in reqs:
                spec &= req.specifier
            if name in exclude:
                picks[name] = Pick(name, "", EXCLUDED, reasons, note=exclude[name] or "excluded with --exclude")
                continue
            host_version = host.get(name)
            if name in local:
                local_meta = read_wheel_meta(local[name])
                if not _version_ok(spec, local_meta.version):
                    conflicts.add(name, local_meta.version, "dist/", [w for _, w in reqs])
                over = f"; the host's {host_version} is overridden" if host_version else ""
                take_wheel(local[name], DIST, reasons, extras, "from dist/" + over)
                continue
            if name in prefer:
                want = prefer[name]
                reasons.append(Reason("--prefer", str(want)))
                path = fetch(name, want.specifier, target)
                version = read_wheel_meta(path).version
                if not _version_ok(spec, version):
                    conflicts.add(
                        name, version, "--prefer", [w for r, w in reqs if not _version_ok(r.specifier, version)]
                    )
                over = f"; the host's {host_version} is overridden" if host_version else ""
                take_wheel(path, PREFERRED, reasons, extras, f"--prefer {want}" + over)
                continue
            if host_version is not None and (host_version == "" or _version_ok(spec, host_version)):
                picks[name] = Pick(name, host_version, HOST, reasons, note="satisfied by the host's pip freeze")
                if extras:
                    warnings.append(f"{name}[{','.join(sorted(extras))}]: extras of a host package not checked")
                continue
            if host_version is not None and name in accept_host:
                picks[name] = Pick(
                    name,
                    host_version,
                    HOST_ACCEPTED,
                    reasons,
                    note=f"host has {host_version}, which does not satisfy '{spec}'; used anyway (--accept-host)",
                )
                continue
            unmet = _unmet_require(reqs, [host_version] if host_version is not None else [])
            if unmet:
                conflicts.add(name, host_version, "host", unmet)
                picks[name] = Pick(name, host_version, HOST, reasons, note="the host's version (see the conflict)")
                continue
            replaces = f"; replaces the host's {host_version} (does not satisfy '{spec}')" if host_version else ""
            pins = pinned_by_name.get(name, [])
            unmet = _unmet_require(reqs, [p.version for p in pins])
            if unmet:
                conflicts.add(name, ", ".join(sorted(p.version for p in pins)), "build/pins.toml", unmet)
            fitting = [p for p in pins if _version_ok(spec, p.version)]
            if fitting:
                best = max(fitting, key=lambda p: Version(p.version))
                take_wheel(best.get(), PINNED, reasons, extras, "pinned in build/pins.toml" + replaces)
                continue
            path = fetch(name, spec, target)
            take_wheel(path, DOWNLOADED, reasons, extras, f"newest satisfying '{spec or 'any'}'" + replaces)
    for name in sorted(set(prefer) - set(picks)):
        warnings.append(f"--prefer {prefer[name]}: nothing in the closure requires {name}; ignored")
    for name, reason in sorted((require or {}).items()):
        declared = [r for r in picks[name].reasons if r.by not in (REQUIRE, "--prefer")]
        if declared:
            warnings.append(f"--require {reason.requirement}: {declared[0]} already asks for it; the option can go")
    return Closure(target, picks, conflicts.lines(), warnings)


def _unmet_require(reqs: list[tuple[Requirement, Reason]], versions: list[str]) -> list[Reason]:
    """The --require reasons that none of `versions` (the host's, or the pinned ones) satisfies."""
    if not versions:
        return []
    return [why for r, why in reqs if why.by == REQUIRE and not any(_version_ok(r.specifier, v) for v in versions)]


def _prefetch(names, grouped, fetch, host, local, prefer, exclude, accept_host, pinned_by_name, target, workers):
    """Start the downloads one level will need in parallel (pip is slow to start); the sequential walk then finds
    them in `fetch`'s memo. A failure here is ignored: the walk repeats the call and reports it."""
    jobs = []
    for name in names:
        spec = SpecifierSet()
        for req, _ in grouped[name]:
            spec &= req.specifier
        host_version = host.get(name)
        if name in exclude or name in local:
            continue
        if name in prefer:
            jobs.append((name, prefer[name].specifier))
            continue
        if host_version is not None and (host_version == "" or _version_ok(spec, host_version) or name in accept_host):
            continue
        if any(_version_ok(spec, p.version) for p in pinned_by_name.get(name, [])):
            continue
        jobs.append((name, spec))
    if workers <= 1 or len(jobs) <= 1:
        return
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for fut in [pool.submit(fetch, name, spec, target) for name, spec in jobs]:
            with contextlib.suppress(Exception):  # reported by the sequential walk
                fut.result()


class _Conflicts:
    """Requirements that a picked version does not satisfy, one entry per package however many levels found them."""

    def __init__(self) -> None:
        self.items: dict[str, dict] = {}
        self.other: list[str] = []

    def add(self, name: str, version: str, source: str, bad: Iterable[Reason], picked_for: Iterable[Reason] = ()):
        item = self.items.setdefault(name, {"version": version, "source": source, "bad": [], "for": []})
        item["bad"] += [str(r) for r in bad if str(r) not in item["bad"]]
        item["for"] += [str(r) for r in picked_for if str(r) not in item["for"] and str(r) not in item["bad"]]

    def lines(self) -> list[str]:
        out = list(self.other)
        for name, it in self.items.items():
            text = f"{name}: {it['source']} version {it['version']} does not satisfy " + "; ".join(it["bad"])
            if it["for"]:
                text += " (picked for " + "; ".join(it["for"]) + ")"
            out.append(text)
        return out


def _recheck(pick: Pick, reqs: list[tuple[Requirement, Reason]], conflicts: _Conflicts) -> None:
    if pick.source in (EXCLUDED, HOST_ACCEPTED) or (pick.source == HOST and pick.version == ""):
        return
    bad = [why for r, why in reqs if not _version_ok(r.specifier, pick.version)]
    if bad:
        conflicts.add(pick.name, pick.version, pick.source, bad, pick.reasons)


# --------------------------------------------------------------------------------------------------------------------
# The real fetcher: pip download for the target's tags


class PipFetcher:
    """`pip download --no-deps --only-binary=:all:` for the target into a cache folder; pip picks the newest
    version that satisfies the specifier. The pip configuration of this machine (index, find-links) applies."""

    def __init__(self, dest: Path, python: str = sys.executable, log: Callable[[str], None] = print):
        self.dest = dest
        self.python = python
        self.log = log

    def __call__(self, name: str, spec: SpecifierSet, target: Target) -> Path:
        self.dest.mkdir(parents=True, exist_ok=True)
        cmd = [self.python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check"]
        cmd += ["--python-version", "{}.{}".format(*target.py), "--implementation", "cp"]
        for plat in target.platforms():
            cmd += ["--platform", plat]
        cmd += ["-d", str(self.dest), f"{name}{spec}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-6:])
            raise ClosureError(f"pip download {name}{spec} for {target.describe()} failed:\n{tail}")
        saved = re.findall(r"(?:Saved|File was already downloaded) (\S+\.whl)", proc.stdout)
        for s in saved:
            path = Path(s)
            if not path.is_absolute():
                path = Path.cwd() / path
            if canonicalize_name(parse_wheel_filename(path.name)[0]) == name:
                self.log(f"  downloaded {path.name}")
                return path
        raise ClosureError(f"pip download {name}{spec}: could not tell which file it saved:\n{proc.stdout[-800:]}")


class WheelhouseFetcher:
    """Pick from a local folder of wheels instead of an index (no network): the newest wheel of the name whose
    version satisfies the specifier and whose tags the target accepts."""

    def __init__(self, folder: Path, log: Callable[[str], None] = print):
        self.folder = folder
        self.log = log

    def __call__(self, name: str, spec: SpecifierSet, target: Target) -> Path:
        best: tuple[Version, Path] | None = None
        for path in sorted(self.folder.glob("*.whl")):
            wname, version, _, _ = parse_wheel_filename(path.name)
            if canonicalize_name(wname) != name or not spec.contains(version, prereleases=True):
                continue
            if target.accepts_wheel(path.name) and (best is None or version > best[0]):
                best = (version, path)
        if best is None:
            raise ClosureError(f"no wheel for {name}{spec} ({target.describe()}) in the wheelhouse {self.folder}")
        self.log(f"  wheelhouse {best[1].name}")
        return best[1]


def marker_applies(marker: str, target: Target, extra: str = "") -> bool:
    """Small helper for callers and tests: does `marker` hold on the target?"""
    return Marker(marker).evaluate(target.marker_env(extra))
