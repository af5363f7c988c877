"""The `graphpersist` command: look into an archive, ask whether it would LOAD here, run a program under the runtime.

Subcommands live in a registry so that other modules (and later releases) add theirs with `register()`
without touching this file's parser code. Exit codes follow the house rules: 0 success, 1 a finding (e.g.
`check` found mismatches), 2 misuse or an archive that cannot be read.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from graphpersist import __version__
from graphpersist.archive import safejson
from graphpersist.archive.manifest import FORMAT_VERSION

if TYPE_CHECKING:
    from graphpersist.archive import Archive

EXIT_OK, EXIT_FINDING, EXIT_MISUSE = 0, 1, 2
# `check` inspects, it does not start an engine: its advice names both ways out (LoadRefused's is for a LOAD).
CHECK_ADVICE = (
    "This archive does not fit this host/configuration: start the engine on a host/configuration that matches, "
    "or re-run SAVE here (GRAPHPERSIST_MODE=save or the engine's --graph-persist save) to write an archive for it."
)


@dataclass(frozen=True)
class Command:
    """One subcommand: `configure` adds its arguments, `run` does the work and returns the exit code."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str = ""


_REGISTRY: dict[str, Command] = {}


def register(command: Command) -> Command:
    """Adds a subcommand; names are unique so two modules cannot silently shadow each other."""
    if command.name in _REGISTRY:
        raise ValueError(f"graphpersist subcommand {command.name!r} is already registered")
    _REGISTRY[command.name] = command
    return command


def commands() -> tuple[Command, ...]:
    return tuple(_REGISTRY.values())


def version_text() -> str:
    return f"graphpersist {__version__} (archive format {FORMAT_VERSION})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphpersist",
        description="Inspect and check graphpersist archives (saved CUDA graphs of vLLM / SGLang); run an engine "
        "under the runtime.",
    )
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in commands():
        child = sub.add_parser(
            command.name,
            help=command.help,
            description=command.description or command.help,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        child.add_argument("--version", action="version", version=version_text())
        command.configure(child)
        child.set_defaults(_run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_MISUSE
    from graphpersist.archive import ArchiveError

    try:
        return args._run(args)
    except ArchiveError as exc:
        print(exc, file=sys.stderr)
        return EXIT_MISUSE
    except BrokenPipeError:
        return EXIT_OK


# ---------------------------------------------------------------------------------------------------------
# inspect


def _configure_inspect(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("archive", metavar="DIR", help="the archive directory")
    parser.add_argument("--json", action="store_true", help="print the manifest and rank records as JSON")
    parser.add_argument("--rank", type=int, help="show only this rank")
    parser.add_argument(
        "--no-verify", action="store_true", help="skip hashing every file (sizes and presence are still checked)"
    )


def _run_inspect(args: argparse.Namespace) -> int:
    from graphpersist.archive import open_archive

    archive = open_archive(args.archive, verify_checksums=not args.no_verify)
    ranks = list(archive.ranks) if args.rank is None else [args.rank]
    records = {rank: archive.rank_facts(rank) for rank in ranks}
    if args.json:
        out = {
            "archive": str(archive.root),
            "manifest": archive.manifest.to_dict(),
            "ranks": {str(rank): record.to_dict() for rank, record in records.items()},
        }
        print(json.dumps(out, indent=2, ensure_ascii=False))
    else:
        print(describe(archive, ranks))
    return EXIT_OK


def describe(archive: Archive, ranks: Sequence[int]) -> str:
    """The human-readable summary `inspect` prints."""
    m = archive.manifest
    w = m.world
    total = sum(entry.size for entry in m.files.values())
    env_set = {k: v for k, v in w.env.items() if v is not None}
    env_unset = sorted(k for k, v in w.env.items() if v is None)
    lines = [
        f"archive     {archive.root}",
        f"format      {m.format_version}, written {m.created.created_at} on {m.created.host} "
        f"by graphpersist {m.created.graphpersist_version} (python {m.created.python})",
        f"engine      {w.engine.name} {w.engine.version} (commit {w.engine.commit})",
        f"software    distribution {w.distribution.version}, torch {_v(w.torch.version)}, "
        f"CUDA runtime {_v(w.cuda.runtime)}, driver {_v(w.cuda.driver)} (CUDA API {_v(w.cuda.driver_api)}), "
        f"NCCL {_v(w.nccl.version)}",
        f"gpu         {_v(w.gpu.model)} (compute capability {_v(w.gpu.compute_capability)})",
        f"parallel    world {w.parallel.world_size}: tp {w.parallel.tp_size}, pp {w.parallel.pp_size}, "
        f"ep {w.parallel.ep_size}",
        f"model       dtype {w.model.dtype}, config {w.model.config_fingerprint}",
        f"capture     modes {', '.join(w.capture.modes) or '-'}; {len(w.capture.sizes)} sizes: "
        f"{' '.join(str(s) for s in w.capture.sizes) or '-'}",
        "env pins    " + (", ".join(f"{k}={v!r}" for k, v in env_set.items()) or "-"),
        "  unset     " + (", ".join(env_unset) or "-"),
        "flags       " + (", ".join(f"{k}={json.dumps(v)}" for k, v in w.flags.items()) or "-"),
        f"files       {len(m.files)} files, {_size(total)}",
    ]
    for rank in ranks:
        r = archive.rank_facts(rank)
        used = r.region.final_offset
        nodes = sum(g.node_count for g in r.graphs)
        lines += [
            "",
            f"rank {r.rank}",
            f"  gpu       device {r.device.index}, PCI {r.device.pci_bus_id}, {r.device.uuid}",
            f"  region    base {r.region.base:#x}, size {_size(r.region.size)}, used {_size(used)} "
            f"(final offset {used:#x})",
            f"  pointers  {r.pointers.count} (fingerprint {r.pointers.fingerprint})",
            f"  images    {len(r.images)}, {_size(sum(i.size for i in r.images))}, "
            f"{sum(len(i.entries) for i in r.images)} kernel entries",
            f"  graphs    {len(r.graphs)}, {nodes} nodes",
        ]
        if r.graphs:
            width = max(len(g.name) for g in r.graphs)
            lines.append(f"    {'name':<{width}}  {'nodes':>6}  {'kernels':>7}  {'images':>6}  topology  node types")
            for g in r.graphs:
                kinds = ", ".join(f"{k} {n}" for k, n in sorted(g.nodes_by_type.items()))
                lines.append(
                    f"    {g.name:<{width}}  {g.node_count:>6}  {g.kernel_count:>7}  {len(g.images):>6}  "
                    f"{g.topology_fingerprint[:8]:<8}  {kinds}"
                )
    return "\n".join(lines)


def _v(value: Any) -> str:
    return "?" if value is None else str(value)


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


# ---------------------------------------------------------------------------------------------------------
# check

_CHECK_EPILOG = """\
Host facts (torch, CUDA, NCCL, GPU, environment pins) are collected here. Facts only the engine knows
(engine.*, model.*, capture.*, parallel.*, region.*, flags.*) are not checked unless given with --set;
they are listed as "not checked", never counted as passed. Values are read as JSON where the saved value is
not a string (--set parallel.tp_size=2, --set capture.sizes=[1,2,4]); --set env.NAME=<unset> means unset.
The rank's GPU slot (device.pci_bus_id; the GPU's UUID is recorded, not compared, so another node of the
same kind passes) is looked up for the device index the rank saved with, or the one given with
--set device.index=N, where nvidia-smi's numbering can be mapped to CUDA's (one GPU, CUDA_VISIBLE_DEVICES with
GPU UUIDs, or CUDA_DEVICE_ORDER=PCI_BUS_ID); device.index itself is only checked when given. Run it in the
environment the engine will start in: the environment pins are read from it.
"""


def _configure_check(parser: argparse.ArgumentParser) -> None:
    parser.epilog = _CHECK_EPILOG
    parser.add_argument("archive", metavar="DIR", help="the archive directory")
    parser.add_argument("--rank", type=int, default=0, help="which rank's facts to check (default 0)")
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="supply a live fact this host cannot know (repeatable)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--no-verify", action="store_true", help="skip hashing every file")


def _run_check(args: argparse.Namespace) -> int:
    from graphpersist.archive import open_archive
    from graphpersist.archive.liveenv import collect_live, set_field
    from graphpersist.archive.validate import MISSING, evaluate, mismatch_report, saved_facts

    archive = open_archive(args.archive, verify_checksums=not args.no_verify)
    rank = args.rank
    saved = saved_facts(archive, rank)
    sets: dict[str, Any] = {}
    for item in args.sets:
        field, sep, text = item.partition("=")
        if not sep or not field:
            print(f"graphpersist check: --set wants FIELD=VALUE, got {item!r}", file=sys.stderr)
            return EXIT_MISUSE
        sets[field] = _parse_value(text, saved.get(field, MISSING))
    # The GPU this rank would use: the one given, else the index it saved with (an assumption, so the index
    # itself counts as checked only when given; its UUID and PCI bus id are real lookups).
    device = sets.get("device.index", saved.get("device.index", 0))
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        print(f"graphpersist check: device.index must be a device number, got {device!r}", file=sys.stderr)
        return EXIT_MISUSE
    live = collect_live(device=device)
    live.get("device", {}).pop("index", None)
    for field, value in sets.items():
        set_field(live, field, value)
    set_field(live, "parallel.rank", rank)
    result = evaluate(archive, live, rank, skip_unknown=True)
    mismatches, checked, not_checked = result.mismatches, result.checked, result.not_checked

    if args.json:

        def side(value: Any) -> Any:
            return None if value is MISSING else value

        out = {
            "archive": str(archive.root),
            "rank": rank,
            "ok": not mismatches,
            "mismatches": [
                {
                    "field": m.field,
                    "saved": side(m.saved),
                    "live": side(m.live),
                    "saved_missing": m.saved is MISSING,
                    "live_missing": m.live is MISSING,
                    "line": str(m),
                }
                for m in mismatches
            ],
            "checked": checked,
            "not_checked": not_checked,
        }
        print(json.dumps(out, indent=2, ensure_ascii=False))
    else:
        if mismatches:
            print(mismatch_report(archive.root, mismatches, rank, CHECK_ADVICE))
        else:
            print(f"graphpersist: archive {archive.root} fits this host for rank {rank}: {len(checked)} fields match")
        if not_checked:
            print(f"not checked ({len(not_checked)}; supply with --set FIELD=VALUE): {', '.join(not_checked)}")
    return EXIT_FINDING if mismatches else EXIT_OK


def _parse_value(text: str, saved: Any) -> Any:
    """A --set value, typed like the saved one: strings stay strings ("9.0" is not a number here)."""
    if text == "<unset>":
        return None
    if isinstance(saved, str):
        return text
    try:
        return safejson.loads(text)
    except safejson.JsonError:
        return text


def _configure_diff(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", metavar="A", help="an archive directory")
    parser.add_argument("b", metavar="B", help="another archive of the same configuration")
    parser.add_argument("--rank", type=int, help="compare only this rank (default: every rank both have)")
    parser.add_argument("--limit", type=int, default=5, help="show at most this many items per list (default 5)")


def _run_diff(args: argparse.Namespace) -> int:
    from graphpersist.archive import diff, open_archive
    from graphpersist.errors import PersistError

    a, b = open_archive(args.a), open_archive(args.b)
    common = [r for r in a.ranks if r in b.ranks]
    ranks = common if args.rank is None else [args.rank]
    if not ranks or any(r not in common for r in ranks):
        print(f"graphpersist diff: rank(s) {args.rank if args.rank is not None else ''} not in both archives (A has "
              f"{list(a.ranks)}, B has {list(b.ranks)})", file=sys.stderr)  # fmt: skip
        return EXIT_MISUSE
    try:
        lines = diff.diff_archives(a, b, ranks, max(args.limit, 1))
    except (PersistError, ValueError) as exc:  # a damaged graph pack or pointer inventory
        print(f"graphpersist diff: {exc}", file=sys.stderr)
        return EXIT_MISUSE
    print(diff.describe(a.root, b.root, ranks, lines))
    return EXIT_FINDING if lines else EXIT_OK


def _configure_exec(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("argv", nargs=argparse.REMAINDER, metavar="PROGRAM [ARG ...]", help="what to run")


def _run_exec(args: argparse.Namespace) -> int:
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        print("graphpersist exec: name the program to run, e.g. `graphpersist exec python app.py`", file=sys.stderr)
        return EXIT_MISUSE
    from graphpersist.memory import region

    env = region.preload_env()
    print(f"graphpersist: running {shlex.join(argv)} under the interposer ({env['LD_PRELOAD']})", file=sys.stderr)
    sys.stderr.flush()
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        print(f"graphpersist exec: cannot run {argv[0]!r}: {exc}", file=sys.stderr)
    return EXIT_MISUSE


register(
    Command(
        name="diff",
        help="where two archives' graphs differ: pointers, kernels, shapes, edges, parameter words (exit 1 if so)",
        description=(
            "Compares two archives of one configuration (two SAVEs must write the same archive) rank by rank:\n"
            "the pointer inventories, naming the graph, kernel node and parameter bytes where each address only\n"
            "one archive has is used, and every graph of the same name: its kernel sequence, its topology (node\n"
            "kinds, launch shapes, attributes, events, edges; listed first) and its parameters word by word.\n"
            "Words that are addresses in the rank's region are marked (region).\n\n"
            "  graphpersist diff /archives/a /archives/b --rank 0"
        ),
        configure=_configure_diff,
        run=_run_diff,
    )
)
register(
    Command(
        name="exec",
        help="run a program under the runtime's interposer, so the engine processes it starts can fork",
        description=(
            "Runs PROGRAM with the runtime's interposer preloaded (LD_PRELOAD) and the address region's base in the\n"
            "environment. With persistence on, an engine started from such a process forks its engine and worker\n"
            "processes as upstream does; without it they are spawned and each imports the engine again.\n\n"
            "  graphpersist exec vllm serve MODEL --graph-persist load --graph-persist-dir /archives/qwen3\n"
            "  graphpersist exec -- python app.py"
        ),
        configure=_configure_exec,
        run=_run_exec,
    )
)
register(
    Command(
        name="inspect",
        help="show what an archive holds: graphs, nodes, kernels, images, memory layout, fingerprints",
        configure=_configure_inspect,
        run=_run_inspect,
    )
)
register(
    Command(
        name="check",
        help="check an archive's manifest against this host and configuration (exit 1 on mismatch)",
        configure=_configure_check,
        run=_run_check,
    )
)


if __name__ == "__main__":
    raise SystemExit(main())
