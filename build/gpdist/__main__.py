"""Command line of the distribution build: `python -m gpdist build|fetch` (`make build` runs it)."""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
from pathlib import Path

from gpdist import pins as pins_mod
from gpdist.engine import BuildError, build_engine_wheels
from gpdist.fetch import FetchError, fetch
from gpdist.report import write_report
from gpdist.runtime import build_runtime


def _engines(pins: pins_mod.Pins, which: str) -> list[pins_mod.EnginePin]:
    if which == "all":
        return list(pins.engines.values())
    return [pins.engine(which)]


def cmd_build(args: argparse.Namespace) -> int:
    pins = pins_mod.load()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Remove only what a build of ours writes: --out may be a folder that holds other wheels too.
    ours = [pins.runtime_name, *(e.dist_name for e in pins.engines.values())]
    for stale in [*out.glob("*.partial"), out / "BUILD-REPORT.md", out / "build-report.json"]:
        stale.unlink(missing_ok=True)
    for project in ours:
        for stale in out.glob(f"{project}-*.whl"):
            stale.unlink()
    start = time.monotonic()
    runtime = build_runtime(pins, out)
    builds = [b for e in _engines(pins, args.engine) for b in build_engine_wheels(pins, e, out, offline=args.offline)]
    _, md_path = write_report(pins, builds, runtime, out)
    print(f"gpdist: built {len(builds) + 1} wheel(s) in {time.monotonic() - start:.1f} s; report: {md_path}")
    for wheel in sorted(out.glob("*.whl")):
        print(f"  {wheel}")
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    pins = pins_mod.load()
    for engine in _engines(pins, args.engine):
        artifacts = [*engine.wheels] + ([engine.sdist] if args.sdist and engine.sdist else [])
        for artifact in artifacts:
            print(fetch(artifact, offline=args.offline))
    return 0


ENVIRONMENT = """environment:
  GP_CACHE_DIR   download cache, keyed by sha256 (default $XDG_CACHE_HOME/graphpersist-dist, else
                 ~/.cache/graphpersist-dist); with a warm cache --offline needs no network at all
  GP_INDEX_URL   package index to download from (default https://pypi.org/simple)

Run from the repository with PYTHONPATH=build:tools:overlays/graphpersist, or use `make build` (OFFLINE=1 for
--offline), which sets it. Exit 0 on success, 1 when the build or a download fails, 2 on misuse."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpdist",
        description="Build the patched engine wheels and the graphpersist runtime wheel from build/pins.toml.",
        epilog=ENVIRONMENT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{build,fetch}")
    engines = ["all", *pins_mod.load().engines]
    names = ", ".join(engines[1:])

    build = sub.add_parser(
        "build",
        help="fetch, verify, patch, overlay, stamp and write wheels",
        description=textwrap.fill(
            "Fetch each pinned upstream wheel (verified by its sha256 in build/pins.toml), apply "
            "patches/<engine>/series with zero fuzz, copy overlays/<engine>/, stamp the version, and write the "
            "engine wheels, the graphpersist runtime wheel and BUILD-REPORT.md / build-report.json to --out.",
            100,
        ),
        epilog=ENVIRONMENT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    build.add_argument(
        "--engine",
        choices=engines,
        default="all",
        help=f"which patched engine wheel to build: one of {names}, or all (default); "
        "the graphpersist runtime wheel is always built",
    )
    build.add_argument("--out", default="dist", help="output folder for wheels and the build report (default dist)")
    build.add_argument(
        "--offline",
        action="store_true",
        help="use only the download cache ($GP_CACHE_DIR); fail, never download, when a file is missing or "
        "fails its sha256",
    )
    build.set_defaults(func=cmd_build)

    fetch_p = sub.add_parser(
        "fetch",
        help="download and verify the pinned upstream artifacts into the cache",
        description=textwrap.fill(
            "Download the pinned upstream artifacts into the cache ($GP_CACHE_DIR) and verify their sha256; "
            "print the path of each verified file.",
            100,
        ),
        epilog=ENVIRONMENT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    fetch_p.add_argument(
        "--engine", choices=engines, default="all", help=f"whose artifacts: one of {names}, or all (default)"
    )
    fetch_p.add_argument("--sdist", action="store_true", help="also fetch the sdist where one is pinned")
    fetch_p.add_argument("--offline", action="store_true", help="only verify what is cached; never download")
    fetch_p.set_defaults(func=cmd_fetch)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (BuildError, FetchError) as exc:
        print(f"gpdist: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
