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
from datetime import UTC, datetime
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename

from gpdist.pins import load as load_pins
from gptools import bundle_archive as ba
from gptools import bundle_closure as bc

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


def build_one(engine: str, args: argparse.Namespace, host: dict[str, str], target: bc.Target) -> dict:
    """Resolve, trim, pack and describe one engine's bundle. Returns the manifest."""
    t0 = time.monotonic()
    engine_wheel = args.engine_wheel or _find_dist_wheel(args.dist, engine)
    if engine_wheel is None or not engine_wheel.exists():
        raise UsageError(f"no {engine} wheel in {args.dist}: run `make build` first (or pass --engine-wheel)")
    local = {}
    runtime = _find_dist_wheel(args.dist, RUNTIME) if args.dist.exists() else None
    if runtime is None:
        # Never let the resolver fetch "graphpersist" from an index: only our own build is the runtime.
        raise UsageError(f"no {RUNTIME} wheel in {args.dist}: run `make build` first (the engines require it)")
    local[RUNTIME] = runtime
    libraries, library_requires = _library_wheels(args.dist, args.with_library, target)
    local |= libraries
    prefer_lines = list(args.prefer) + [c.read_text() for c in args.constraints]
    exclude = _parse_excludes(args.exclude)
    try:
        prefer = bc.parse_prefer(prefer_lines)
        require = bc.parse_require([*args.require, *library_requires])
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if both := sorted(set(require) & set(exclude)):
        raise UsageError(f"--require and --exclude both name {', '.join(both)}: keep one")
    cache = args.download_cache or _default_cache()
    log(f"{engine}: resolving the closure of {engine_wheel.name} for {target.describe()}")
    closure = bc.resolve(
        [engine_wheel],
        target=target,
        host=host,
        fetcher=bc.WheelhouseFetcher(args.wheelhouse, log=log) if args.wheelhouse else bc.PipFetcher(cache, log=log),
        local=local,
        pinned=_pinned_wheels(),
        prefer=prefer,
        exclude=exclude,
        accept_host=set(args.accept_host),
        require=require,
        progress=log,
    )
    for w in closure.warnings:
        log(f"warning: {w}")
    wheels = []
    for pick in closure.bundled():
        wheels.append(
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
        )
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
        "options": {
            "prefer": [str(r) for r in prefer.values()],
            "exclude": args.exclude,
            "require": args.require,
            "with_library": args.with_library,
            "accept_host": args.accept_host,
            "drop_path": args.drop_path,
            "part_size": args.part_size_bytes,
            "compression": args.compression,
        },
        "conflicts": closure.conflicts,
        "warnings": closure.warnings,
        "wheels": wheels,
        "not_bundled": not_bundled,
    }
    total = sum(w["size"] for w in wheels)
    log(
        f"{engine}: {len(wheels)} wheels to bundle ({total / ba.MiB:.1f} MiB), "
        f"{sum(p['source'] == bc.HOST for p in not_bundled)} requirements satisfied by the host, "
        f"{sum(p['source'] == bc.EXCLUDED for p in not_bundled)} excluded, "
        f"{sum(p['source'] == bc.HOST_ACCEPTED for p in not_bundled)} host versions accepted"
    )
    out_dir = args.out / engine
    if closure.conflicts and not args.dry_run:
        # Nothing is written, and an older bundle must not be mistaken for this run's result.
        for old in [
            *out_dir.glob("*.part[0-9][0-9][0-9]"),
            *(out_dir / n for n in ("manifest.json", "install.sh", "SHA256SUMS", "requirements.lock")),
        ]:
            old.unlink(missing_ok=True)
    if closure.conflicts:
        for c in closure.conflicts:
            log(f"CONFLICT: {c}")
        log(
            "resolve them with --prefer NAME==VER, --accept-host NAME or --exclude NAME (all recorded); "
            "for a --require: change its version, or --prefer the same version to replace the host's"
        )
        manifest["status"] = "conflicts"
        return manifest
    if args.dry_run:
        manifest["status"] = "dry-run"
        return manifest

    out_dir = args.out / engine
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in [
        *out_dir.glob("*.part[0-9][0-9][0-9]"),
        *(out_dir / n for n in ("manifest.json", "install.sh", "SHA256SUMS", "requirements.lock")),
    ]:
        old.unlink(missing_ok=True)
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
    return manifest


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
    engines = list(SERVING) if args.engine == "all" else [args.engine]
    results = [build_one(e, args, host, target) for e in engines]
    if args.json:
        print(json.dumps(results, indent=2, default=str))
    else:
        for m in results:
            _print_summary(m)
    return 1 if any(m["status"] == "conflicts" for m in results) else 0


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
