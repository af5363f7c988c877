"""Does this archive fit this process? Compare every saved fact with its live value; refuse LOAD on any drift.

Facts are compared as flat dotted fields ("parallel.tp_size", "env.NCCL_ALGO"), the names users see. The rules:

* every saved field must be present live and equal; a field known on one side only is a mismatch (`<missing>`),
  so a fact the engine forgot to supply refuses LOAD instead of passing unchecked;
* None is a value ("unset"): an environment pin unset at SAVE and set at LOAD is drift;
* lists compare in order, mappings by their leaves, numbers and strings by value and type.

Only preconditions are compared here (what must hold before the first replay). Outcomes such as the region's
final offset, the pointer inventory and each graph's topology are checked by the runtime as it restores them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from graphpersist.archive import codec
from graphpersist.archive.shown import shown

if TYPE_CHECKING:
    from graphpersist.archive import Archive

ADVICE = "Re-run with mode=save for this configuration."

# Rank facts that must match before restoring (the rest of rank.json is outcome, checked during restore). The
# device fields pin each rank to the GPU slot it saved on (CUDA index and PCI bus id): ranks that swap GPUs are
# refused. The GPU's UUID is recorded but not compared: it names one physical card, and an archive must LOAD on
# another node of the same kind (gpu.model, compute capability, driver and NCCL versions are world facts, the
# slot is the PCI bus id, and the setup phases prove NCCL laid its buffers out as at SAVE).
RANK_FIELDS: Final = (
    "parallel.rank",
    "device.index",
    "device.pci_bus_id",
    "region.base",
    "region.size",
)
# Live-only fields in these namespaces are drift too: a pin or flag SAVE did not record may change the graphs.
OPEN_NAMESPACES: Final = ("env.", "flags.")


class _Missing:
    """The value of a field one side does not have (distinct from None, which means 'unset')."""

    def __repr__(self) -> str:
        return "<missing>"


MISSING: Final = _Missing()


@dataclass(frozen=True)
class Mismatch:
    """One field whose saved and live values differ; str() is the line users read."""

    field: str
    saved: Any
    live: Any

    def __str__(self) -> str:
        saved, live = render(self.field, self.saved), render(self.field, self.live)
        return f"{shown(self.field)}: saved {saved}, live {live}"


def render(field: str, value: Any) -> str:
    """A value as mismatch lines show it: strings quoted, None as <unset>, region numbers in hex."""
    if value is MISSING:
        return "<missing>"
    if value is None:
        return "<unset>"
    if isinstance(value, int) and not isinstance(value, bool) and field.startswith("region."):
        return hex(value)
    if isinstance(value, str):
        return shown(repr(value))
    if isinstance(value, list | tuple):
        return "[" + ", ".join(render(field, v) for v in value) + "]"
    return json.dumps(value) if isinstance(value, bool) else repr(value)


def flatten(facts: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings to dotted leaves: {"parallel": {"tp_size": 2}} -> {"parallel.tp_size": 2}.

    Keys that already contain dots are kept as they are, so flat and nested input mix freely. An empty
    mapping contributes no field (e.g. no flags recorded).
    """
    out: dict[str, Any] = {}
    for key, value in facts.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _normal(value: Any) -> Any:
    """Tuples and lists are the same JSON; compare what the archive would store."""
    if isinstance(value, list | tuple):
        return [_normal(v) for v in value]
    return value


def _same(a: Any, b: Any) -> bool:
    if a is MISSING or b is MISSING:
        return False
    a, b = _normal(a), _normal(b)
    return type(a) is type(b) and a == b


def compare(
    saved: Mapping[str, Any], live: Mapping[str, Any], *, fields: Sequence[str] | None = None
) -> list[Mismatch]:
    """Every field that differs, in the saved facts' order, then live-only fields. Nested input is flattened.

    `fields` restricts the comparison to those names (a name absent on either side then counts as missing).
    """
    flat_saved, flat_live = flatten(saved), flatten(live)
    if fields is None:
        names = list(flat_saved) + [name for name in flat_live if name not in flat_saved]
    else:
        names = list(dict.fromkeys(fields))
    out = []
    for name in names:
        a, b = flat_saved.get(name, MISSING), flat_live.get(name, MISSING)
        if not _same(a, b):
            out.append(Mismatch(name, a, b))
    return out


class LoadRefused(RuntimeError):
    """LOAD must not go on: the archive was saved under different conditions. The message says what to do.

    The first line names the rank that refused (when given): in a multi-rank job each rank checks its own
    facts, and `device.*` or `region.*` lines only make sense knowing whose they are.
    """

    def __init__(self, archive_dir: Path | str, mismatches: Sequence[Mismatch], rank: int | None = None) -> None:
        self.archive_dir = Path(archive_dir)
        self.mismatches = list(mismatches)
        self.rank = rank
        super().__init__(mismatch_report(self.archive_dir, self.mismatches, rank, ADVICE))


# From this many fields known on one side only, they are named on one line per side instead of one line each: an
# archive of an earlier build (SGLang records every server argument) would otherwise be refused in hundreds of lines.
ONE_SIDED_LISTED = 8
# Fields that digest others (the model configuration's fingerprint, vLLM's configuration hash): listed after the
# fields that say what changed, so a refusal's first line is the setting a user changed, not a pair of hashes.
DIGESTS: Final = ("config_fingerprint", "_hash")


def mismatch_report(archive_dir: Path | str, mismatches: Sequence[Mismatch], rank: int | None, advice: str) -> str:
    """The lines users read: which archive and rank cannot LOAD, one line per mismatch (digests of other fields last:
    `DIGESTS`), then `advice`. Many fields known on one side only (`ONE_SIDED_LISTED`) are named together, one line
    for each side.

    An engine start (LoadRefused) and `graphpersist check` list the same mismatches but advise differently.
    """
    n = len(mismatches)
    who = "" if rank is None else f" (rank {rank})"
    lines = [f"graphpersist: cannot LOAD {shown(str(archive_dir))}{who}: {n} mismatch{'es' if n != 1 else ''}"]
    mismatches = sorted(mismatches, key=lambda m: m.field.endswith(DIGESTS))  # stable: digests last
    live_only = [m for m in mismatches if m.saved is MISSING]
    saved_only = [m for m in mismatches if m.live is MISSING]
    grouped = {id(m) for group in (live_only, saved_only) if len(group) >= ONE_SIDED_LISTED for m in group}
    lines += [f"  {m}" for m in mismatches if id(m) not in grouped]
    for group, where in ((live_only, "live, not in the archive (saved <missing>)"),
                         (saved_only, "in the archive, not live (live <missing>)")):  # fmt: skip
        if len(group) >= ONE_SIDED_LISTED:
            names = ", ".join(shown(m.field) for m in group)
            lines.append(f"  {len(group)} fields {where}; an archive of another build? {names}")
    lines.append(advice)
    return "\n".join(lines)


def saved_facts(archive: Archive, rank: int) -> dict[str, Any]:
    """The flat facts LOAD must match for `rank`: format version, the world, and the rank's preconditions."""
    manifest = archive.manifest
    facts = {"format_version": manifest.format_version, **flatten(codec.to_dict(manifest.world))}
    if rank in archive.ranks:
        record = archive.rank_facts(rank)
        facts |= {
            "parallel.rank": record.rank,
            "device.index": record.device.index,
            "device.pci_bus_id": record.device.pci_bus_id,
            "region.base": record.region.base,
            "region.size": record.region.size,
        }
    return facts


def comparable_fields(saved: Mapping[str, Any], live: Mapping[str, Any]) -> list[str]:
    """The fields LOAD compares: all saved ones, plus live pins and flags the archive does not know."""
    flat_saved, flat_live = flatten(saved), flatten(live)
    extra = [name for name in flat_live if name.startswith(OPEN_NAMESPACES) and name not in flat_saved]
    return list(flat_saved) + extra


@dataclass(frozen=True)
class CheckResult:
    """The outcome of comparing an archive with live facts: what differed, what was compared, what was not."""

    mismatches: list[Mismatch]
    checked: list[str]
    not_checked: list[str]

    @property
    def ok(self) -> bool:
        return not self.mismatches


def evaluate(archive: Archive, live: Mapping[str, Any], rank: int, *, skip_unknown: bool = False) -> CheckResult:
    """Compares `archive` (as `rank` sees it) with `live`.

    LOAD uses skip_unknown=False: a saved fact absent from `live` is a mismatch. `graphpersist check` uses True:
    it cannot know the engine's facts, so it lists them as not checked (and never as passed).
    """
    live_flat = flatten(live)
    live_flat.setdefault("parallel.rank", rank)
    saved = saved_facts(archive, rank)
    fields = comparable_fields(saved, live_flat)
    checked = [f for f in fields if f in live_flat] if skip_unknown else fields
    not_checked = [f for f in fields if f not in live_flat] if skip_unknown else []
    mismatches = compare(saved, live_flat, fields=checked)
    if rank not in archive.ranks:
        mismatches = [m for m in mismatches if m.field not in RANK_FIELDS]
        mismatches.append(Mismatch("parallel.rank", list(archive.ranks), rank))
    return CheckResult(mismatches, checked, not_checked)


def check(archive: Archive, live: Mapping[str, Any], rank: int) -> list[Mismatch]:
    """All mismatches between `archive` (as seen by `rank`) and `live`; [] when LOAD may proceed."""
    return evaluate(archive, live, rank).mismatches


def check_or_refuse(archive: Archive, live: Mapping[str, Any], rank: int) -> None:
    """Raises LoadRefused listing every mismatch; returns quietly when the archive fits."""
    mismatches = check(archive, live, rank)
    if mismatches:
        raise LoadRefused(archive.root, mismatches, rank)
