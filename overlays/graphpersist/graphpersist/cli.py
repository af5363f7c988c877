"""The `graphpersist` command: look into an archive, ask whether it would LOAD here, run a program under the runtime.

Subcommands live in a registry so that other modules (and later releases) add theirs with `register()`
without touching this file's parser code. Exit codes follow the house rules: 0 success, 1 a finding (e.g.
`check` found mismatches), 2 misuse or an archive that cannot be read; and 3 when `check` could not compare the
archive with this host at all (no torch, CUDA or GPU here to measure). Everything printed goes through
graphpersist.archive.shown: an archive's strings never reach the terminal as control characters.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from graphpersist import __version__
from graphpersist.archive import codec, safejson
from graphpersist.archive.manifest import FORMAT_VERSION
from graphpersist.archive.shown import shown, terminal_safe

if TYPE_CHECKING:
    from graphpersist.archive import Archive
    from graphpersist.archive.validate import CheckResult
    from graphpersist.loadstage import Verified

EXIT_OK, EXIT_FINDING, EXIT_MISUSE, EXIT_UNCHECKED = 0, 1, 2, 3
EXIT_CODES = """\
exit codes:
  0  success (check: the archive fits this host, as far as it was compared)
  1  a finding (check: a mismatch; diff: the archives differ)
  2  misuse, or an archive that cannot be read or trusted (the message names each problem)
  3  check only: this host could not report the facts to compare (no torch, CUDA or GPU here)
"""
# `check` inspects, it does not start an engine: its advice names both ways out (LoadRefused's is for a LOAD).
# The environment pins are read from check's own environment, which is often not the engine's.
ENV_ADVICE = (
    "The live env.* values are this shell's: run `graphpersist check` in the environment the engine starts in (its "
    "exports, its launcher's), or give them with --set env.NAME=VALUE."
)
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


def out(text: str = "", *, err: bool = False) -> None:
    """Prints one block of output, its archive strings already shown() and the whole made terminal-safe."""
    print(terminal_safe(text), file=sys.stderr if err else sys.stdout)


def out_json(doc: Any) -> None:
    """Prints JSON with every non-ASCII character escaped (and DEL, the one ASCII control JSON leaves raw)."""
    print(json.dumps(doc, indent=2, ensure_ascii=True).replace("\x7f", "\\u007f"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphpersist",
        description="Inspect and check graphpersist archives (saved CUDA graphs of vLLM / SGLang); run an engine "
        "under the runtime.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
        child.set_defaults(_run=command.run, _parser=child)
    return parser


def _refuse_unknown(parser: argparse.ArgumentParser, extra: list[str]) -> None:
    """Exits 2 naming the arguments `parser` (the subcommand's, when one was named) does not take, with its usage
    and the closest option it has, as argparse would for the top-level parser."""
    options = [o for action in parser._actions for o in action.option_strings]
    hints = []
    for arg in extra:
        close = difflib.get_close_matches(arg.split("=", 1)[0], options, 1) if arg.startswith("-") else []
        if close:
            hints.append(f"{arg}: did you mean {close[0]}?")
    parser.error(f"unrecognized arguments: {' '.join(extra)}" + (f" ({'; '.join(hints)})" if hints else ""))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        _refuse_unknown(getattr(args, "_parser", parser), extra)
    if getattr(args, "_run", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_MISUSE
    from graphpersist.archive import ArchiveError

    try:
        return args._run(args)
    except ArchiveError as exc:
        out(str(exc), err=True)
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
    if args.rank is not None and args.rank not in archive.ranks:
        have = ", ".join(map(str, archive.ranks))
        out(f"graphpersist inspect: {shown(str(archive.root))} has no rank {args.rank}; ranks {have}", err=True)
        return EXIT_MISUSE
    ranks = list(archive.ranks) if args.rank is None else [args.rank]
    records = {rank: archive.rank_facts(rank) for rank in ranks}
    if args.json:
        doc = {
            "archive": str(archive.root),
            "manifest": codec.to_dict(archive.manifest),
            "ranks": {str(rank): codec.to_dict(record) for rank, record in records.items()},
        }
        out_json(doc)
    else:
        out(describe(archive, ranks))
    return EXIT_OK


def describe(archive: Archive, ranks: Sequence[int]) -> str:
    """The human-readable summary `inspect` prints; every archive string shown() (escaped, one line each)."""
    m = archive.manifest
    w = m.world
    s = shown
    total = sum(entry.size for entry in m.files.values())
    env_set = {k: v for k, v in w.env.items() if v is not None}
    env_unset = sorted(k for k, v in w.env.items() if v is None)
    lines = [
        f"archive     {s(str(archive.root))}",
        f"format      {m.format_version}, written {s(m.created.created_at)} on {s(m.created.host)} "
        f"by graphpersist {s(m.created.graphpersist_version)} (python {s(m.created.python)})",
        f"engine      {s(w.engine.name)} {s(w.engine.version)} (commit {s(w.engine.commit)})",
        f"software    distribution {s(w.distribution.version)}, torch {_v(w.torch.version)}, "
        f"CUDA runtime {_v(w.cuda.runtime)}, driver {_v(w.cuda.driver)} (CUDA API {_v(w.cuda.driver_api)}), "
        f"NCCL {_v(w.nccl.version)}",
        f"gpu         {_v(w.gpu.model)} (compute capability {_v(w.gpu.compute_capability)})",
        f"parallel    world {w.parallel.world_size}: tp {w.parallel.tp_size}, pp {w.parallel.pp_size}, "
        f"ep {w.parallel.ep_size}",
        f"model       dtype {s(w.model.dtype)}, config {s(w.model.config_fingerprint)}",
        f"capture     modes {', '.join(map(s, w.capture.modes)) or '-'}; {len(w.capture.sizes)} sizes: "
        f"{' '.join(str(n) for n in w.capture.sizes) or '-'}",
        "env pins    " + (", ".join(f"{s(k)}={v!r}" for k, v in env_set.items()) or "-"),
        "  unset     " + (", ".join(map(s, env_unset)) or "-"),
        "flags       " + (", ".join(f"{s(k)}={json.dumps(v)}" for k, v in w.flags.items()) or "-"),
        f"files       {len(m.files)} files, {_size(total)}",
    ]
    for rank in ranks:
        r = archive.rank_facts(rank)
        used = r.region.final_offset
        nodes = sum(g.node_count for g in r.graphs)
        lines += [
            "",
            f"rank {r.rank}",
            f"  gpu       device {r.device.index}, PCI {s(r.device.pci_bus_id)}, {s(r.device.uuid)}",
            f"  region    base {r.region.base:#x}, size {_size(r.region.size)}, used {_size(used)} "
            f"(final offset {used:#x})",
            f"  pointers  {r.pointers.count} (fingerprint {s(r.pointers.fingerprint)})",
            f"  images    {len(r.images)}, {_size(sum(i.size for i in r.images))}, "
            f"{sum(len(i.entries) for i in r.images)} kernel entries",
            f"  graphs    {len(r.graphs)}, {nodes} nodes",
        ]
        if r.graphs:
            names = [s(g.name, 120) for g in r.graphs]
            width = max(len(n) for n in names)
            lines.append(f"    {'name':<{width}}  {'nodes':>6}  {'kernels':>7}  {'images':>6}  topology  node types")
            for g, name in zip(r.graphs, names, strict=True):
                kinds = ", ".join(f"{s(k)} {n}" for k, n in sorted(g.nodes_by_type.items()))
                lines.append(
                    f"    {name:<{width}}  {g.node_count:>6}  {g.kernel_count:>7}  {len(g.images):>6}  "
                    f"{s(g.topology_fingerprint[:8]):<8}  {kinds}"
                )
    return "\n".join(lines)


def _v(value: Any) -> str:
    return "?" if value is None else shown(str(value))


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


# ---------------------------------------------------------------------------------------------------------
# check

_CHECK_EPILOG = f"""\
Host facts (torch, CUDA, NCCL, GPU, environment pins) are collected here. Facts only the engine knows
(engine.*, model.*, capture.*, parallel.*, region.*, flags.*) are not checked unless given with --set;
they are listed as "not checked", never counted as passed. Values are read as JSON where the saved value is
not a string (--set parallel.tp_size=2, --set capture.sizes=[1,2,4]); --set env.NAME=<unset> means unset.
--set takes the archive's fact names (a name it does not know is refused, listing the ones it knows), any
env.NAME or flags.NAME (an extra pin or flag is drift), and device.index.
The rank's GPU slot (device.pci_bus_id; the GPU's UUID is recorded, not compared, so another node of the
same kind passes) is looked up for the device index the rank saved with, or the one given with
--set device.index=N, where nvidia-smi's numbering can be mapped to CUDA's (one GPU, CUDA_VISIBLE_DEVICES with
GPU UUIDs, or CUDA_DEVICE_ORDER=PCI_BUS_ID); device.index itself is only checked when given. Run it in the
environment the engine will start in: the environment pins are read from it. Where this host cannot report
its torch, CUDA, NCCL or GPU facts (no torch, no driver), it says so and exits 3: nothing was compared.

The archive is verified as LOAD reads it, every byte LOAD would use (file hashes, each graph's parts and
kernel table, images, declared state, the records' commitments); --quick skips the payloads (manifest and rank
records only) and says so.

{EXIT_CODES}"""
# World facts only this host can report; when it cannot, `check` compared nothing that matters (exit 3).
HOST_FACTS = ("torch.", "cuda.", "nccl.", "gpu.")


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
    parser.add_argument(
        "--quick",
        "--no-verify",
        dest="quick",
        action="store_true",
        help="skip verifying the payloads (graphs, images, state): the manifest and rank records only",
    )


def _run_check(args: argparse.Namespace) -> int:
    from graphpersist import loadstage
    from graphpersist.archive import open_archive
    from graphpersist.archive.liveenv import collect_live, set_field
    from graphpersist.archive.validate import evaluate, saved_facts

    archive = open_archive(args.archive, verify_checksums=not args.quick)
    rank = args.rank
    sets = _check_sets(args.sets, saved_facts(archive, rank))
    if isinstance(sets, str):
        out(sets, err=True)
        return EXIT_MISUSE
    # The GPU this rank would use: the one given, else the index it saved with (an assumption, so the index
    # itself counts as checked only when given; its UUID and PCI bus id are real lookups).
    device = sets.get("device.index", saved_facts(archive, rank).get("device.index", 0))
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        out(f"graphpersist check: device.index must be a device number, got {shown(repr(device))}", err=True)
        return EXIT_MISUSE
    # LOAD's CPU stage for every rank, every byte, and the shared files (ArchiveError: exit 2, naming the problem)
    verified = None if args.quick else loadstage.verify_all(archive)
    live = collect_live(device=device)
    live.get("device", {}).pop("index", None)
    for field, value in sets.items():
        set_field(live, field, value)
    set_field(live, "parallel.rank", rank)
    result = evaluate(archive, live, rank, skip_unknown=True)
    unmeasured = [f for f in result.not_checked if f.startswith(HOST_FACTS)]
    code = EXIT_FINDING if result.mismatches else EXIT_UNCHECKED if unmeasured else EXIT_OK
    if args.json:
        out_json(_check_doc(archive, rank, code, result, unmeasured, verified))
    else:
        out(_check_text(archive, rank, result, unmeasured, verified, sets))
    return code


def _check_sets(items: list[str], saved: dict[str, Any]) -> dict[str, Any] | str:
    """The facts given with --set, typed like the saved ones; or the line that says why one is refused."""
    from graphpersist.archive.validate import MISSING

    sets: dict[str, Any] = {}
    for item in items:
        field, sep, text = item.partition("=")
        if not sep or not field:
            return f"graphpersist check: --set wants FIELD=VALUE, got {shown(repr(item))}"
        unknown = _unknown_field(field, saved)
        if unknown:
            return unknown
        sets[field] = _parse_value(text, saved.get(field, MISSING))
    return sets


def _check_doc(
    archive: Archive, rank: int, code: int, result: CheckResult, unmeasured: list[str], verified: Verified | None
) -> dict[str, Any]:
    """What `check --json` prints."""
    from graphpersist.archive.validate import MISSING

    def side(value: Any) -> Any:
        return None if value is MISSING else value

    mismatches = [
        {"field": m.field, "saved": side(m.saved), "live": side(m.live), "saved_missing": m.saved is MISSING,
         "live_missing": m.live is MISSING, "line": str(m)}
        for m in result.mismatches
    ]  # fmt: skip
    payloads: Any = "not verified (--quick)"
    if verified is not None:
        payloads = {"graphs": verified.graphs, "images": verified.images, "bytes": verified.bytes,
                    "shared": verified.shared}  # fmt: skip
    return {
        "archive": str(archive.root),
        "rank": rank,
        "ok": code == EXIT_OK,
        "verdict": {EXIT_OK: "fits", EXIT_FINDING: "mismatch", EXIT_UNCHECKED: "unchecked"}[code],
        "mismatches": mismatches,
        "checked": result.checked,
        "not_checked": result.not_checked,
        "unmeasured": unmeasured,
        "payloads": payloads,
    }


def _check_text(
    archive: Archive, rank: int, result: CheckResult, unmeasured: list[str], verified: Verified | None,
    given: dict[str, Any],
) -> str:  # fmt: skip
    """What `check` prints: the verdict (and, where env.* read here differ, that they are this shell's), what was
    verified, what was not checked."""
    from graphpersist.archive.validate import mismatch_report

    root = shown(str(archive.root))
    lines = []
    if result.mismatches:
        lines.append(mismatch_report(archive.root, result.mismatches, rank, CHECK_ADVICE))
        if any(m.field.startswith("env.") and m.field not in given for m in result.mismatches):
            lines.append(ENV_ADVICE)
    elif unmeasured:
        lines += [
            f"graphpersist: cannot tell whether archive {root} fits this host for rank {rank}: this host could not "
            f"report {', '.join(map(shown, unmeasured))} (no torch, CUDA driver or GPU here?); the "
            f"{len(result.checked)} fields it could compare match",
            "Run `graphpersist check` on the host that will LOAD it, in the engine's environment, or give those "
            "facts with --set FIELD=VALUE.",
        ]
    else:
        lines.append(f"graphpersist: archive {root} fits this host for rank {rank}: {len(result.checked)} fields match")
    if verified is not None:
        shared = f", shared {', '.join(verified.shared)}" if verified.shared else ""
        lines.append(f"payloads verified: {verified.graphs} graphs, {verified.images} kernel images, "
                     f"{verified.bytes} bytes{shared}, as LOAD reads them")  # fmt: skip
    else:
        lines.append("payloads not verified (--quick): only the manifest and the rank records were read")
    if result.not_checked:
        lines.append(f"not checked ({len(result.not_checked)}; supply with --set FIELD=VALUE): "
                     f"{', '.join(map(shown, result.not_checked))}")  # fmt: skip
    return "\n".join(lines)


def _unknown_field(field: str, saved: dict[str, Any]) -> str | None:
    """Why `--set field=...` would be ignored (a typo, a fact LOAD does not compare), or None when it is taken."""
    from graphpersist.archive.validate import OPEN_NAMESPACES

    if field == "device.index" or (field in saved and field != "parallel.rank"):
        return None
    if any(field.startswith(ns) and len(field) > len(ns) for ns in OPEN_NAMESPACES):
        return None
    known = sorted(f for f in saved if not f.startswith(OPEN_NAMESPACES) and f != "parallel.rank")
    known = sorted({*known, "device.index"})
    if field == "parallel.rank":
        why = "the rank is chosen with --rank"
    else:
        close = difflib.get_close_matches(field, [*known, *(f for f in saved if f.startswith(OPEN_NAMESPACES))], 1)
        why = f"no such field{f' (did you mean {close[0]}?)' if close else ''}"
    return (
        f"graphpersist check: --set {shown(field, 80)}: {why}. The fields it takes: {', '.join(map(shown, known))}, "
        "and env.NAME or flags.NAME"
    )


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
    from graphpersist import diff
    from graphpersist.archive import open_archive
    from graphpersist.errors import PersistError

    a, b = open_archive(args.a), open_archive(args.b)
    common = [r for r in a.ranks if r in b.ranks]
    ranks = common if args.rank is None else [args.rank]
    if not ranks or any(r not in common for r in ranks):
        out(f"graphpersist diff: rank(s) {args.rank if args.rank is not None else ''} not in both archives (A has "
            f"{list(a.ranks)}, B has {list(b.ranks)})", err=True)  # fmt: skip
        return EXIT_MISUSE
    try:
        lines = diff.diff_archives(a, b, ranks, max(args.limit, 1))
    except (PersistError, ValueError) as exc:  # a damaged pointer inventory or kernel-choice notes
        out(f"graphpersist diff: {shown(str(exc))}", err=True)
        return EXIT_MISUSE
    out(diff.describe(a.root, b.root, ranks, lines))
    return EXIT_FINDING if lines else EXIT_OK


def _configure_allocdiff(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("save", metavar="SAVE", help="SAVE's trace, e.g. DIR/save-rank0.json.gz")
    parser.add_argument("load", metavar="LOAD", help="LOAD's trace of the same rank, e.g. DIR/load-rank0.json.gz")


def _run_allocdiff(args: argparse.Namespace) -> int:
    from pathlib import Path

    from graphpersist.memory import alloctrace

    try:
        saved, live = alloctrace.read(Path(args.save)), alloctrace.read(Path(args.load))
    except ValueError as exc:
        out(f"graphpersist allocdiff: {exc}", err=True)
        return EXIT_MISUSE
    found = alloctrace.parting(saved, live)
    out(found or f"SAVE and LOAD made the same {len(saved)} allocator actions up to mark_setup().")
    return EXIT_FINDING if found else EXIT_OK


def _configure_exec(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("argv", nargs=argparse.REMAINDER, metavar="PROGRAM [ARG ...]", help="what to run")


def _run_exec(args: argparse.Namespace) -> int:
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        out("graphpersist exec: name the program to run, e.g. `graphpersist exec python app.py`", err=True)
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
            "kinds, launch shapes, attributes, events, edges; listed first), its parameters word by word, and\n"
            "every other field LOAD reads of it (memset/memcpy fields, functions, static tensor records, ...).\n"
            "Words that are addresses in the rank's region are marked (region).\n\n"
            "  graphpersist diff /archives/a /archives/b --rank 0"
        ),
        configure=_configure_diff,
        run=_run_diff,
    )
)
register(
    Command(
        name="allocdiff",
        help="where SAVE's and LOAD's allocations parted before a setup tensor moved (exit 1 if they did)",
        description=(
            "Compares the allocator actions two starts made up to mark_setup(), as recorded with\n"
            "GRAPHPERSIST_ALLOC_TRACE=DIR set for SAVE and for LOAD (torch's allocation history with Python\n"
            "stacks; off by default, it slows every allocation), and names the first action where they part: an\n"
            "allocation or free only one start made, with where it was asked for. A LOAD refused with `setup\n"
            "tensor N differs` says which files to compare.\n\n"
            "  GRAPHPERSIST_ALLOC_TRACE=/tmp/trace <SAVE command>; GRAPHPERSIST_ALLOC_TRACE=/tmp/trace <LOAD command>\n"
            "  graphpersist allocdiff /tmp/trace/save-rank0.json.gz /tmp/trace/load-rank0.json.gz"
        ),
        configure=_configure_allocdiff,
        run=_run_allocdiff,
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
