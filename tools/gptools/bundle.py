"""`gptools bundle`: an offline bundle of our engine wheels plus the dependency wheels a target host lacks.

For air-gapped GPU hosts. Given the host's `pip freeze` and its Python/glibc, it writes to <out>/<engine>/:

  <stem>.tar.gz.part000 ...   one archive (wheels/*.whl) split into parts of at most --part-size bytes
  manifest.json               every wheel (name, version, sha256, source, which requirement asked for it), every
                              requirement the host satisfies or that was excluded, every part's and the archive's sha256
  SHA256SUMS                  the parts, for `sha256sum -c`
  requirements.lock           the bundled wheels as NAME==VER --hash=sha256:...
  install.sh                  verifies every part and the joined archive, then `pip install --no-index --no-deps`

Our dist/ wheels travel byte-identical unless --drop-path asks, explicitly, to leave files out of one for transfer
(the rewritten wheel gets a correct RECORD and the manifest names the dropped files and the original sha256).

Arguments can come from a file: `gptools bundle @recipes/gpu-host/vllm.args` (one option per line, # comments).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from gpdist.pins import load as load_pins
from gptools import bundle_archive as ba
from gptools import bundle_closure as bc
from gptools import bundle_lock as bl

RUNTIME = load_pins().runtime_name
# The serving engines: a library such as deep_ep is patched and built like them but gets no bundle of its own.
SERVING = load_pins().serving_engines

DEFAULT_PART_SIZE = "52MiB"  # a call carries 64 MiB with the working tree (6.2 MiB on 2026-12-01) and install.sh
DEFAULT_OUT = ".bundle"


class UsageError(Exception):
    """Misuse: exit 2."""


def log(msg: str) -> None:
    print(f"bundle: {msg}", file=sys.stderr, flush=True)


class _ArgFileParser(argparse.ArgumentParser):
    """@file arguments: one or more shell-quoted options per line, '#' starts a comment."""

    def convert_arg_line_to_args(self, arg_line: str) -> list[str]:
        return shlex.split(arg_line, comments=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dist", type=Path, default=Path("dist"), help="folder with our built wheels (default: dist)")
    p.add_argument(
        "--engine",
        choices=[*SERVING, "all"],
        default="vllm",
        help="which engine to bundle; 'all' writes one self-contained bundle per engine (default: vllm)",
    )
    p.add_argument(
        "--engine-wheel",
        type=Path,
        metavar="WHL",
        help="use this engine wheel instead of the one in --dist (e.g. a pristine upstream wheel)",
    )
    p.add_argument(
        "--host-freeze",
        type=Path,
        metavar="FILE",
        help="the target host's `pip freeze`; requirements it satisfies are not bundled "
        "(without it, everything is bundled)",
    )
    p.add_argument(
        "--python-version",
        default="3.12.3",
        metavar="X.Y[.Z]",
        help="the target's CPython version (markers, wheel tags; default 3.12.3)",
    )
    p.add_argument(
        "--glibc",
        default="2.39",
        metavar="X.Y",
        help="the target's glibc: manylinux wheels up to this are accepted (default 2.39)",
    )
    _add_resolution_arguments(p)
    _add_output_arguments(p)


def _add_resolution_arguments(p: argparse.ArgumentParser) -> None:
    """How the closure is decided: what `--write-lock` records among the lock's inputs."""
    p.add_argument(
        "--prefer",
        action="append",
        default=[],
        metavar="NAME==VER",
        help="use exactly this version of NAME (over pins, over the host's version); repeatable; "
        "e.g. --prefer transformers==5.12.1",
    )
    p.add_argument(
        "--constraints",
        action="append",
        default=[],
        type=Path,
        metavar="FILE",
        help="a file of --prefer lines (NAME==VER, # comments)",
    )
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="NAME[=REASON]",
        help="do not bring NAME (nor what only it needs) although an engine declares it; recorded in the "
        "manifest with the reason; repeatable",
    )
    p.add_argument(
        "--require",
        action="append",
        default=[],
        metavar="NAME==VER[=REASON]",
        help="bring NAME although no engine declares it (the engine imports it, e.g. only an excluded package "
        "declares it); walked like a declared requirement, its own requirements too; a host or pinned version "
        "that differs is a conflict; recorded in the manifest with the reason; repeatable; e.g. "
        "--require 'dill==0.4.1=imported by sglang/srt/sampling/custom_logit_processor.py'",
    )
    p.add_argument(
        "--with-library",
        action="append",
        default=[],
        metavar="NAME[=REASON]",
        help="bring our own dist/ wheel of NAME (a library this distribution builds, e.g. deep_ep) that the engine "
        "imports but does not declare: the one for the target's Python, at its exact version, never an index's; "
        "recorded in the manifest with the reason; repeatable",
    )
    p.add_argument(
        "--accept-host",
        action="append",
        default=[],
        metavar="NAME",
        help="use the host's NAME even where its version does not satisfy a requirement (recorded)",
    )


def _add_output_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--drop-path",
        action="append",
        default=[],
        metavar="GLOB",
        help="leave files matching GLOB (path inside an engine wheel, * crosses /) out of that wheel for "
        "transfer; the wheel is rewritten inside the bundle with a correct RECORD; repeatable",
    )
    p.add_argument(
        "--part-size",
        default=DEFAULT_PART_SIZE,
        metavar="SIZE",
        help=f"largest part (default {DEFAULT_PART_SIZE}; K/M/G[iB] are binary)",
    )
    p.add_argument(
        "--compression",
        choices=sorted(ba.COMPRESSIONS),
        default="gz",
        help="archive compression (default gz; xz is smaller for a --drop-path-rewritten wheel, which is "
        "then stored uncompressed inside)",
    )
    p.add_argument("--out", type=Path, default=Path(DEFAULT_OUT), help="output folder (default .bundle)")
    p.add_argument(
        "--wheelhouse",
        type=Path,
        metavar="DIR",
        help="take dependency wheels from this folder instead of `pip download` (no network)",
    )
    p.add_argument(
        "--download-cache",
        type=Path,
        metavar="DIR",
        help="where downloaded dependency wheels are kept (default: <gpdist cache>/bundle-wheels)",
    )
    p.add_argument(
        "--lock",
        type=Path,
        metavar="FILE",
        help="bundle exactly the wheels FILE names (e.g. recipes/gpu-host/vllm.lock): index wheels by sha256 from the "
        "cache or downloaded by file name, never resolved; refused when the options, the host freeze, the target or "
        "a dist/ version differ from those it was made with",
    )
    p.add_argument(
        "--write-lock",
        type=Path,
        metavar="FILE",
        help="resolve the closure against the index (as without --lock) and write it to FILE; no bundle is written",
    )
    p.add_argument(
        "--offline",
        action="store_true",
        help="with --lock: take every file from the cache, download nothing (a missing one is an error)",
    )
    p.add_argument("--dry-run", action="store_true", help="compute and print the closure; write no bundle")
    p.add_argument(
        "--verify",
        type=Path,
        metavar="BUNDLE_DIR",
        help="only verify an existing bundle folder's parts against its manifest.json",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bundle",
        help="offline bundle of dist/ wheels + missing dependency wheels, in verified parts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        fromfile_prefix_chars="@",
    )
    p.convert_arg_line_to_args = _ArgFileParser.convert_arg_line_to_args.__get__(p)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


# --------------------------------------------------------------------------------------------------------------------


def _find_dist_wheel(dist: Path, project: str) -> Path | None:
    found = [w for w in sorted(dist.glob("*.whl")) if canonicalize_name(parse_wheel_filename(w.name)[0]) == project]
    if len(found) > 1:
        raise UsageError(f"{dist} holds {len(found)} wheels of {project}: {', '.join(w.name for w in found)}")
    return found[0] if found else None


def _library_wheels(dist: Path, values: list[str], target: bc.Target) -> tuple[dict[str, Path], list[str]]:
    """--with-library: {name: our dist/ wheel of it for `target`} and the `--require NAME==VER=REASON` lines that
    bring each at exactly that version. Misuse (none for the target, or several) is a UsageError."""
    local: dict[str, Path] = {}
    require: list[str] = []
    for value in values:
        name, _, why = value.partition("=")
        project = canonicalize_name(name.strip())
        ours = [w for w in sorted(dist.glob("*.whl")) if canonicalize_name(parse_wheel_filename(w.name)[0]) == project]
        fits = [w for w in ours if target.accepts_wheel(w.name)]
        if len(fits) != 1:
            found = ", ".join(w.name for w in ours) or "none"
            raise UsageError(f"--with-library {name}: {len(fits)} wheels of {project} in {dist} fit "
                             f"{target.describe()} (its wheels there: {found}): run `make build` first")  # fmt: skip
        version = parse_wheel_filename(fits[0].name)[1]
        local[project] = fits[0]
        require.append(f"{name.strip()}=={version}={why.strip() or 'our build (--with-library)'}")
    return local, require


def _pinned_wheels() -> list[bc.PinnedWheel]:
    try:
        from gpdist import fetch, pins
    except ImportError:  # gpdist not on the path: no pinned preferences
        return []
    out = []
    for art in pins.load().dependencies.values():
        name, version, _, _ = parse_wheel_filename(art.filename)
        out.append(bc.PinnedWheel(str(name), str(version), lambda art=art: fetch.fetch(art)))
    return out


def _default_cache() -> Path:
    try:
        from gpdist.fetch import cache_dir

        return cache_dir() / "bundle-wheels"
    except ImportError:
        return Path.home() / ".cache" / "graphpersist-dist" / "bundle-wheels"


def _parse_excludes(values: list[str]) -> dict[str, str]:
    out = {}
    for v in values:
        name, _, reason = v.partition("=")
        if not name.strip():
            raise UsageError(f"--exclude {v!r}: give a package name")
        out[canonicalize_name(name.strip())] = reason.strip()
    return out


def _why(pick: bc.Pick) -> str:
    if not pick.reasons:
        return pick.note
    first = pick.reasons[0]
    more = f" +{len(pick.reasons) - 1} more" if len(pick.reasons) > 1 else ""
    if first.by == bc.REQUIRE:
        return f"{first.by} {first.requirement}: {first.why or 'no reason given'}{more}"
    return f"{first.by} requires {first.requirement}{more}"


@dataclass
class Plan:
    """What one engine's bundle carries, however it was decided: resolved now, or read from a lock."""

    wheels: list[dict]  # manifest entries; "_path" is the file (None in a --dry-run from a lock)
    not_bundled: list[dict]
    conflicts: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Options:
    """The resolution options, parsed: the closure walk takes them, a lock records them as its inputs."""

    prefer: dict[str, Requirement]
    exclude: dict[str, str]
    require: dict[str, bc.Reason]  # --require only (a --with-library's version comes from dist/)

    def inputs(self, args: argparse.Namespace, target: bc.Target) -> bl.Inputs:
        freeze = ba.sha256_file(args.host_freeze) if args.host_freeze else ""
        libraries = {canonicalize_name(v.partition("=")[0].strip()) for v in args.with_library}
        return bl.Inputs(
            python=target.python_full_version,
            glibc=target.glibc,
            host_freeze_sha256=freeze,
            prefer=tuple(sorted(str(r) for r in self.prefer.values())),
            exclude=tuple(sorted(self.exclude)),
            require=tuple(sorted(f"{n}=={r.requirement.partition('==')[2]}" for n, r in self.require.items())),
            with_library=tuple(sorted(libraries)),
            accept_host=tuple(sorted({canonicalize_name(n) for n in args.accept_host})),
        )


def _options(args: argparse.Namespace) -> Options:
    exclude = _parse_excludes(args.exclude)
    try:
        prefer = bc.parse_prefer(list(args.prefer) + [c.read_text() for c in args.constraints])
        require = bc.parse_require(args.require)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if both := sorted(set(require) & set(exclude)):
        raise UsageError(f"--require and --exclude both name {', '.join(both)}: keep one")
    return Options(prefer, exclude, require)


def _resolve_plan(
    engine: str, args: argparse.Namespace, host: dict[str, str], target: bc.Target, opts: Options
) -> Plan:
    """Today's walk against the index (or --wheelhouse): what `--write-lock` records and a lock-less bundle carries."""
    engine_wheel = args.engine_wheel or _find_dist_wheel(args.dist, engine)
    if engine_wheel is None or not engine_wheel.exists():
        raise UsageError(f"no {engine} wheel in {args.dist}: run `make build` first (or pass --engine-wheel)")
    runtime = _find_dist_wheel(args.dist, RUNTIME) if args.dist.exists() else None
    if runtime is None:
        # Never let the resolver fetch "graphpersist" from an index: only our own build is the runtime.
        raise UsageError(f"no {RUNTIME} wheel in {args.dist}: run `make build` first (the engines require it)")
    libraries, library_requires = _library_wheels(args.dist, args.with_library, target)
    require = {**opts.require, **bc.parse_require(library_requires)}
    cache = args.download_cache or _default_cache()
    log(f"{engine}: resolving the closure of {engine_wheel.name} for {target.describe()}")
    closure = bc.resolve(
        [engine_wheel],
        target=target,
        host=host,
        fetcher=bc.WheelhouseFetcher(args.wheelhouse, log=log) if args.wheelhouse else bc.PipFetcher(cache, log=log),
        local={RUNTIME: runtime, **libraries},
        pinned=_pinned_wheels(),
        prefer=opts.prefer,
        exclude=opts.exclude,
        accept_host=set(args.accept_host),
        require=require,
        progress=log,
    )
    for w in closure.warnings:
        log(f"warning: {w}")
    wheels = [
        {
            "file": pick.path.name,
            "name": pick.name,
            "version": pick.version,
            "sha256": ba.sha256_file(pick.path),
            "size": pick.path.stat().st_size,
            "source": pick.source,
            "why": _why(pick),
            "required_by": [str(r) for r in pick.reasons],
            "note": pick.note,
            "_path": pick.path,
        }
        for pick in closure.bundled()
    ]
    not_bundled = [
        {
            "name": p.name,
            "version": p.version,
            "source": p.source,
            "required_by": [str(r) for r in p.reasons],
            "note": p.note,
        }
        for p in sorted(closure.picks.values(), key=lambda p: p.name)
        if not p.bundled
    ]
    return Plan(wheels, not_bundled, closure.conflicts, closure.warnings)


def _lock_plan(engine: str, args: argparse.Namespace, target: bc.Target, opts: Options) -> Plan:
    """The lock's wheels: ours from dist/ (same name and version), the others by sha256 from the cache or the index.
    Nothing is resolved; a lock made from other inputs is refused as stale."""
    lock = bl.load(args.lock)
    stale = [f"engine: locked {lock.engine}, live {engine}"] if lock.engine != engine else []
    stale += lock.inputs.differences(opts.inputs(args, target))
    paths: dict[str, Path] = {}
    for entry in (e for e in lock.wheels if e.from_dist):
        given = args.engine_wheel if entry.name == engine else None
        path = given or _dist_wheel(args.dist, entry, target)
        paths[entry.name] = path
        if Version(str(parse_wheel_filename(path.name)[1])) != Version(entry.version):
            stale.append(f"{entry.name}: locked {entry.version}, {path.parent}/ has {path.name}")
    if stale:
        raise bl.LockError(
            stale,
            f"the lock {args.lock} was resolved for other inputs: refresh it with `make bundle-lock ENGINE={engine}` "
            "(resolves against the index again; review the diff), or restore the inputs it was made with",
        )
    log(f"{engine}: {len(lock.wheels)} wheels from the lock {args.lock} (locked {lock.locked}); no resolution")
    if not args.dry_run:
        files = bl.fetch_all(lock.wheels, offline=args.offline, log=log)
        paths |= {e.name: files[e.file] for e in lock.wheels if not e.from_dist}
    wheels = []
    for e in lock.wheels:
        path = paths.get(e.name)
        ours = e.from_dist  # found in dist/ above; an index wheel's path is None in a --dry-run
        wheels.append(
            {
                "file": path.name if ours else e.file,
                "name": e.name,
                "version": e.version,
                "sha256": ba.sha256_file(path) if ours else e.sha256,
                "size": path.stat().st_size if ours else e.size,
                "source": e.source,
                "why": e.why,
                "required_by": list(e.required_by),
                "note": e.note,
                "_path": path,
            }
        )
    not_bundled = [{**asdict(h), "required_by": list(h.required_by)} for h in lock.not_bundled]
    return Plan(wheels, not_bundled)


def _dist_wheel(dist: Path, entry: bl.Entry, target: bc.Target) -> Path:
    ours = [w for w in sorted(dist.glob("*.whl")) if canonicalize_name(parse_wheel_filename(w.name)[0]) == entry.name]
    fits = [w for w in ours if target.accepts_wheel(w.name)]
    if len(fits) != 1:
        found = ", ".join(w.name for w in ours) or "none"
        raise UsageError(f"the lock brings our {entry.name} {entry.version}: {len(fits)} of its wheels in {dist} fit "
                         f"{target.describe()} (its wheels there: {found}): run `make build` first")  # fmt: skip
    return fits[0]


def _write_lock(engine: str, args: argparse.Namespace, plan: Plan, inputs: bl.Inputs) -> None:
    """--write-lock: record the resolved plan, once the index is seen to serve every file the lock names, and put the
    files in the cache the lock path reads (so the bundle after a refresh downloads nothing again)."""
    entries = []
    for w in plan.wheels:
        ours = w["source"] == bc.DIST
        entries.append(
            bl.Entry(
                name=w["name"],
                version=w["version"],
                source=w["source"],
                why=w["why"],
                note=w["note"],
                required_by=tuple(w["required_by"]),
                file="" if ours else w["file"],
                sha256="" if ours else w["sha256"],
                size=0 if ours else w["size"],
            )
        )
    log(f"{engine}: checking that the index serves each of the {sum(not e.from_dist for e in entries)} locked files")
    if problems := bl.check_on_index(entries):
        raise bl.LockError(problems, "not written: a bundle from this lock could not download these files by name")
    for entry, w in zip(entries, plan.wheels, strict=True):
        if not entry.from_dist:
            bl.seed_cache(entry, w["_path"])
    held = tuple(
        bl.Held(h["name"], h["version"], h["source"], h["note"], tuple(h["required_by"])) for h in plan.not_bundled
    )
    created = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    freeze = str(args.host_freeze) if args.host_freeze else ""
    bl.write(args.write_lock, bl.Lock(engine, created, freeze, inputs, tuple(entries), held))
    log(f"{engine}: wrote the lock {args.write_lock}: {len(entries)} wheels; `make bundle` now brings exactly these")


def build_one(engine: str, args: argparse.Namespace, host: dict[str, str], target: bc.Target) -> dict:
    """Decide (resolve, or read the lock), then pack and describe one engine's bundle. Returns the manifest."""
    t0 = time.monotonic()
    opts = _options(args)
    try:
        plan = _lock_plan(engine, args, target, opts) if args.lock else _resolve_plan(engine, args, host, target, opts)
    except bl.LockError:
        if not args.dry_run:
            _remove_outputs(args.out / engine)  # an older bundle must not be mistaken for this run's result
        raise
    manifest = {
        "format": ba.FORMAT,
        "engine": engine,
        "created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "target": {
            "python": target.python_full_version,
            "glibc": target.glibc,
            "machine": target.machine,
            "platform_tags": target.platforms(),
        },
        "host_freeze": (
            {"file": str(args.host_freeze), "sha256": ba.sha256_file(args.host_freeze), "packages": len(host)}
            if args.host_freeze
            else None
        ),
        "lock": {"file": str(args.lock), "sha256": ba.sha256_file(args.lock)} if args.lock else None,
        "options": {
            "prefer": [str(r) for r in opts.prefer.values()],
            "exclude": args.exclude,
            "require": args.require,
            "with_library": args.with_library,
            "accept_host": args.accept_host,
            "drop_path": args.drop_path,
            "part_size": args.part_size_bytes,
            "compression": args.compression,
        },
        "conflicts": plan.conflicts,
        "warnings": plan.warnings,
        "wheels": plan.wheels,
        "not_bundled": plan.not_bundled,
    }
    total = sum(w["size"] for w in plan.wheels)
    log(
        f"{engine}: {len(plan.wheels)} wheels to bundle ({total / ba.MiB:.1f} MiB), "
        f"{sum(p['source'] == bc.HOST for p in plan.not_bundled)} requirements satisfied by the host, "
        f"{sum(p['source'] == bc.EXCLUDED for p in plan.not_bundled)} excluded, "
        f"{sum(p['source'] == bc.HOST_ACCEPTED for p in plan.not_bundled)} host versions accepted"
    )
    if plan.conflicts:
        if not args.dry_run and not args.write_lock:
            _remove_outputs(args.out / engine)  # an older bundle must not be mistaken for this run's result
        for c in plan.conflicts:
            log(f"CONFLICT: {c}")
        log(
            "resolve them with --prefer NAME==VER, --accept-host NAME or --exclude NAME (all recorded); "
            "for a --require: change its version, or --prefer the same version to replace the host's"
        )
        manifest["status"] = "conflicts"
    elif args.dry_run:
        manifest["status"] = "dry-run"
    elif args.write_lock:
        _write_lock(engine, args, plan, opts.inputs(args, target))
        manifest["status"] = "locked"
    else:
        _write_bundle(engine, args, manifest, t0)
    for w in plan.wheels:
        w.pop("_path", None)
    return manifest


def _remove_outputs(out_dir: Path) -> None:
    for old in [
        *out_dir.glob("*.part[0-9][0-9][0-9]"),
        *(out_dir / n for n in ("manifest.json", "install.sh", "SHA256SUMS", "requirements.lock")),
    ]:
        old.unlink(missing_ok=True)


def _write_bundle(engine: str, args: argparse.Namespace, manifest: dict, t0: float) -> None:
    """Pack the plan's wheels into parts and write manifest.json, SHA256SUMS, requirements.lock and install.sh."""
    wheels = manifest["wheels"]
    out_dir = args.out / engine
    out_dir.mkdir(parents=True, exist_ok=True)
    _remove_outputs(out_dir)
    staging = out_dir / ".staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        if args.drop_path:
            _trim_engines(wheels, args, staging)
        root = f"gpbundle-{engine}"
        members = [(f"{root}/wheels/{w['file']}", w["_path"]) for w in wheels]
        log(
            f"{engine}: writing the {args.compression} archive in parts of at most "
            f"{args.part_size_bytes / ba.MiB:.1f} MiB"
        )
        t1 = time.monotonic()
        split, archive_name = ba.write_archive(
            members, out_dir, f"gpbundle-{engine}", args.compression, args.part_size_bytes, progress=log
        )
        pack_s = time.monotonic() - t1
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for w in wheels:
        del w["_path"]
    manifest["archive"] = {
        "name": archive_name,
        "root": root,
        "size": split.total,
        "sha256": split.whole.hexdigest(),
        "wheels_size": sum(w["size"] for w in wheels),
        "pack_seconds": round(pack_s, 1),
    }
    manifest["parts"] = [{"name": p.name, "size": p.size, "sha256": p.sha256} for p in split.parts]
    manifest["status"] = "written"
    ba.write_text(out_dir / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    ba.write_text(out_dir / "SHA256SUMS", "".join(f"{p.sha256}  {p.name}\n" for p in split.parts))
    ba.write_text(
        out_dir / "requirements.lock",
        "".join(
            f"{w['name']}=={w['version']} --hash=sha256:{w['sha256']}  # {w['source']}: {w['why']}\n" for w in wheels
        ),
    )
    ba.write_text(
        out_dir / "install.sh",
        ba.render_install_sh(engine, archive_name, split.whole.hexdigest(), root, split.parts, wheels),
        0o755,
    )
    for p in split.parts:
        log(f"  {p.name}: {p.size / ba.MiB:.1f} MiB sha256 {p.sha256[:16]}…")
    log(
        f"{engine}: {len(split.parts)} part(s), {split.total / ba.MiB:.1f} MiB in {out_dir} "
        f"({time.monotonic() - t0:.0f} s); install with: bash {out_dir}/install.sh [--target DIR]"
    )


def _trim_engines(wheels: list[dict], args: argparse.Namespace, staging: Path) -> None:
    unmatched = set(args.drop_path)
    for w in wheels:
        if w["source"] != bc.DIST or w["name"] == RUNTIME:
            continue
        dest = staging / w["file"]
        log(f"  --drop-path: rewriting {w['file']} without {len(args.drop_path)} glob(s)")
        res = ba.trim_wheel(w["_path"], dest, args.drop_path, w["sha256"], store=args.compression == "xz")
        if not res.dropped:
            continue
        unmatched -= set(args.drop_path) - set(res.unmatched)
        w["trimmed"] = {
            "original_sha256": w["sha256"],
            "original_size": w["size"],
            "dropped": [name for name, _ in res.dropped],
            "dropped_bytes_uncompressed": sum(size for _, size in res.dropped),
            "note": "rewritten for transfer by --drop-path; RECORD rewritten; the dist/ wheel itself is unchanged",
        }
        w["note"] += f"; TRIMMED: {len(res.dropped)} files left out (--drop-path)"
        w["_path"] = dest
        w["sha256"] = ba.sha256_file(dest)
        w["size"] = dest.stat().st_size
        log(
            f"  {w['file']}: {w['trimmed']['original_size'] / ba.MiB:.1f} -> {w['size'] / ba.MiB:.1f} MiB, "
            f"{len(res.dropped)} files dropped"
        )
    if unmatched:
        raise UsageError(f"--drop-path matched nothing in the engine wheels: {', '.join(sorted(unmatched))}")


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except UsageError as exc:
        print(f"gptools bundle: error: {exc}", file=sys.stderr)
        return 2
    except bl.LockError as exc:
        for line in [*exc.lines, exc.advice]:
            print(f"gptools bundle: {line}", file=sys.stderr)
        return 1
    except (bc.ClosureError, OSError, RuntimeError) as exc:
        print(f"gptools bundle: failed: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    if args.verify is not None:
        res = ba.verify_bundle(args.verify, progress=log)
        for p in res.problems:
            print(f"gptools bundle: {p}", file=sys.stderr)
        if args.json:
            print(json.dumps({"ok": res.ok, "problems": res.problems}, indent=2))
        print("bundle verified" if res.ok else f"bundle FAILED verification ({len(res.problems)} problem(s))")
        return 0 if res.ok else 1
    try:
        args.part_size_bytes = ba.parse_size(args.part_size)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.part_size_bytes < 1:
        raise UsageError("--part-size must be positive")
    host: dict[str, str] = {}
    if args.host_freeze is not None:
        if not args.host_freeze.exists():
            raise UsageError(f"--host-freeze {args.host_freeze}: no such file")
        host = bc.parse_freeze(args.host_freeze.read_text())
        log(f"host freeze {args.host_freeze}: {len(host)} packages")
    else:
        log("warning: no --host-freeze: every dependency is bundled (a fresh interpreter is assumed)")
    parts = args.python_version.split(".")
    if len(parts) < 2 or not all(x.isdigit() for x in parts):
        raise UsageError(f"--python-version {args.python_version!r}: expected X.Y or X.Y.Z")
    full = args.python_version if len(parts) == 3 else args.python_version + ".0"
    target = bc.Target(python_version=".".join(parts[:2]), python_full_version=full, glibc=args.glibc)
    if args.engine_wheel is not None and args.engine == "all":
        raise UsageError("--engine-wheel needs one --engine")
    _check_lock_options(args)
    engines = list(SERVING) if args.engine == "all" else [args.engine]
    results = [build_one(e, args, host, target) for e in engines]
    if args.json:
        print(json.dumps(results, indent=2, default=str))
    else:
        for m in results:
            _print_summary(m)
    return 1 if any(m["status"] == "conflicts" for m in results) else 0


def _check_lock_options(args: argparse.Namespace) -> None:
    if args.lock and args.write_lock:
        raise UsageError("--lock bundles from a lock, --write-lock writes one: give one of them")
    if (args.lock or args.write_lock) and args.engine == "all":
        raise UsageError("a lock is one engine's: give --engine with --lock or --write-lock")
    if args.lock and (args.wheelhouse or args.download_cache):
        raise UsageError("--wheelhouse and --download-cache choose versions; --lock names the files: drop them")
    if args.offline and not args.lock:
        raise UsageError("--offline needs --lock (a resolution asks the index)")


def _print_summary(m: dict) -> None:
    print(f"== {m['engine']} bundle: {m['status']}")
    for w in m["wheels"]:
        trim = " [TRIMMED]" if "trimmed" in w else ""
        print(
            f"  bundle  {w['name']:32} {w['version']:16} {w['size'] / ba.MiB:8.1f} MiB  {w['source']:10} "
            f"{w['why']}{trim}"
        )
    for p in m["not_bundled"]:
        if p["source"] != bc.HOST:
            print(f"  {p['source']:8} {p['name']:32} {p['version']:16} {p['note']}")
    host_n = sum(p["source"] == bc.HOST for p in m["not_bundled"])
    print(f"  ({host_n} requirements satisfied by the host)")
    for c in m["conflicts"]:
        print(f"  CONFLICT {c}")
    if "parts" in m:
        sizes = ", ".join(f"{p['size'] / ba.MiB:.1f}" for p in m["parts"])
        print(
            f"  archive {m['archive']['name']}: {m['archive']['size'] / ba.MiB:.1f} MiB in "
            f"{len(m['parts'])} part(s) [{sizes}] MiB"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gptools")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
