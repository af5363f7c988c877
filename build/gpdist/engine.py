"""Build one patched engine wheel: pristine tree -> series -> overlays -> stamp -> reproducible repack."""

from __future__ import annotations

import shutil
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from gpdist.fetch import fetch, sha256_file
from gpdist.pins import Artifact, EnginePin, Pins
from gpdist.unpack import MARKER, WORK_DIR, tree_files, tree_name, upstream_tree
from gpdist.wheelmeta import WheelName, hex_to_record_digest, parse_record, render_record, requires, stamp_metadata
from gpdist.wheelzip import ReproducibleZip, read_raw

NATIVE_SUFFIXES = (".so", ".a", ".cubin", ".fatbin", ".ptx")


class BuildError(RuntimeError):
    """The build cannot produce a correct wheel; the message says what to do."""


@dataclass
class EngineBuild:
    """What one engine build did: the report is written from this."""

    engine: str
    upstream_wheel: str
    upstream_sha256: str
    wheel: Path
    wheel_sha256: str = ""
    patches: list[str] = field(default_factory=list)
    patched_files: list[str] = field(default_factory=list)
    overlay_files: list[str] = field(default_factory=list)
    metadata_files: list[str] = field(default_factory=list)
    unchanged_files: int = 0
    native_files: dict[str, str] = field(default_factory=dict)  # path -> sha256, all verified unchanged


def is_native(path: str, data_head: bytes) -> bool:
    """Native code: shared objects and other ELF files (e.g. vLLM's vllm-rs binary), plus GPU code images."""
    return path.endswith(NATIVE_SUFFIXES) or ".so." in path or data_head.startswith(b"\x7fELF")


def _apply_series(tree: Path, engine: EnginePin) -> tuple[list[str], set[str]]:
    """Apply the series exactly; return the patch names and the files they changed (the only files besides
    overlays and metadata that may differ from upstream)."""
    from gptools.apply import PatchApplyError, apply_series

    try:
        results = apply_series(tree, engine.patches_dir)
    except PatchApplyError as exc:
        raise BuildError(
            f"{exc}\nThe pinned upstream must take the series with zero fuzz: run "
            f"`make edit ENGINE={engine.name}`, fix the patch, then `make export ENGINE={engine.name}`."
        ) from exc
    return [r.name for r in results], {path for r in results for path in r.files}


def _copy_overlay(tree: Path, overlay: Path) -> list[str]:
    """Copy whole new modules onto the wheel root; an overlay never replaces an upstream file."""
    added = []
    if not overlay.is_dir():
        return added
    for src in sorted(overlay.rglob("*")):
        rel = src.relative_to(overlay).as_posix()
        if src.is_dir() or "__pycache__" in src.parts or src.suffix == ".pyc":
            continue
        dest = tree / rel
        if dest.exists():
            raise BuildError(
                f"overlay file overlays/{overlay.name}/{rel} would replace an upstream file; "
                "change upstream files with a patch, not an overlay"
            )
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
        added.append(rel)
    return added


def build_engine_wheels(pins: Pins, engine: EnginePin, out_dir: Path, offline: bool = False) -> list[EngineBuild]:
    """Every pinned wheel of the engine (one per Python for deep_ep), each with the same series and overlay."""
    return [build_engine(pins, engine, out_dir, offline=offline, artifact=a) for a in engine.wheels]


def build_engine(
    pins: Pins, engine: EnginePin, out_dir: Path, offline: bool = False, artifact: Artifact | None = None
) -> EngineBuild:
    """One patched wheel from one of the engine's pinned wheels (default: the primary)."""
    artifact = artifact or engine.wheel
    log = lambda msg: print(f"gpdist[{engine.name}]: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    src_wheel = fetch(artifact, offline=offline)  # verified once here; unpacking uses this same copy
    pristine = upstream_tree(engine, offline=offline, wheel=src_wheel, artifact=artifact)

    stage = WORK_DIR / "build" / (engine.name if artifact == engine.wheel else tree_name(engine, artifact))
    log(f"staging a copy of {artifact.filename}")
    shutil.rmtree(stage, ignore_errors=True)
    shutil.copytree(pristine, stage, ignore=shutil.ignore_patterns(MARKER))

    log(f"applying patches/{engine.name}/series (zero fuzz)")
    applied, patchable = _apply_series(stage, engine)
    log(f"applied {len(applied)} patch(es)")
    overlay_files = _copy_overlay(stage, engine.overlay_dir)
    log(f"copied {len(overlay_files)} overlay file(s) from overlays/{engine.name}/")

    old_name = WheelName.parse(artifact.filename)
    new_version = pins.dist_version(engine.version)
    new_name = pins.dist_wheel(engine, artifact)
    old_info, new_info = old_name.dist_info, new_name.dist_info
    if not (stage / old_info).is_dir():
        raise BuildError(f"{artifact.filename} has no {old_info}/")
    (stage / old_info).rename(stage / new_info)
    metadata_path = stage / new_info / "METADATA"
    metadata = metadata_path.read_text()
    # Every wheel we build requires the runtime, and the torch its native code is built against: upstream declares
    # that for the engines; deep_ep declares nothing (its extension links against torch 2.11.0's libraries).
    added = [f"{pins.runtime_name}=={pins.runtime_version}"]
    if not requires(metadata, "torch"):
        added.append(f"torch=={engine.requires_torch}")
    renamed = new_name.distribution if new_name.distribution != old_name.distribution else None
    metadata_path.write_text(stamp_metadata(metadata, new_version, added, name=renamed))
    log(
        f"stamped version {new_version}{f', name {renamed}' if renamed else ''}, added "
        + ", ".join(f"Requires-Dist: {r}" for r in added)
    )

    upstream_record = parse_record((pristine / old_info / "RECORD").read_text())
    result = EngineBuild(engine.name, artifact.filename, artifact.sha256, out_dir / new_name.filename)
    result.patches = applied

    files = [f for f in tree_files(stage) if f != f"{new_info}/RECORD"]
    dist_info = sorted(f for f in files if f.startswith(f"{new_info}/"))
    body = sorted(f for f in files if not f.startswith(f"{new_info}/"))
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp_wheel = result.wheel.with_name(result.wheel.name + ".partial")
    rows: list[tuple[str, str, str]] = []
    log(f"writing {new_name.filename} ({len(files)} files)")
    with zipfile.ZipFile(src_wheel) as src, ReproducibleZip(tmp_wheel, pins.source_date_epoch) as out:
        upstream_infos = {i.filename: i for i in src.infolist()}
        for rel in body + dist_info:
            path = stage / rel
            executable = bool(path.stat().st_mode & 0o111)
            upstream_rel = old_info + rel[len(new_info) :] if rel.startswith(f"{new_info}/") else rel
            digest_hex = sha256_file(path)
            digest = hex_to_record_digest(digest_hex)
            size = path.stat().st_size
            rows.append((rel, digest, str(size)))
            recorded = upstream_record.get(upstream_rel)
            if recorded is not None and recorded[0] == digest and upstream_rel in upstream_infos:
                out.add_raw(rel, read_raw(src, upstream_infos[upstream_rel]), executable)
                result.unchanged_files += 1
                with path.open("rb") as f:
                    if is_native(rel, f.read(4)):
                        result.native_files[rel] = digest_hex
                continue
            with path.open("rb") as f:
                head = f.read(4)
            if is_native(rel, head):
                raise BuildError(
                    f"native file {rel} differs from upstream; patches and overlays must not change "
                    "native code (upstream native libraries stay byte-identical)"
                )
            if rel in overlay_files:
                result.overlay_files.append(rel)
            elif rel.startswith(f"{new_info}/"):
                result.metadata_files.append(rel)
            elif rel in patchable:
                result.patched_files.append(rel)
            else:
                raise BuildError(
                    f"{rel} differs from upstream but no patch or overlay changes it (was {pristine} edited?); "
                    "run `make clean` and build again"
                )
            out.add_bytes(rel, path.read_bytes(), executable)
        record_name = f"{new_info}/RECORD"
        rows.append((record_name, "", ""))
        out.add_bytes(record_name, render_record(rows))
    try:
        _check_record_complete(upstream_record, old_info, new_info, rows)
    except BuildError:
        tmp_wheel.unlink(missing_ok=True)
        raise
    tmp_wheel.replace(result.wheel)
    result.wheel_sha256 = sha256_file(result.wheel)
    log(
        f"wrote {result.wheel} ({result.wheel.stat().st_size / 2**20:.1f} MiB): {len(result.patched_files)} patched, "
        f"{len(result.overlay_files)} overlay, {result.unchanged_files} byte-identical "
        f"({len(result.native_files)} native)"
    )
    return result


def _check_record_complete(upstream: dict, old_info: str, new_info: str, rows: list[tuple[str, str, str]]) -> None:
    """Every upstream file must still be in the wheel: a build never drops a file silently."""
    ours = {r[0] for r in rows}
    for path in upstream:
        mapped = new_info + path[len(old_info) :] if path.startswith(f"{old_info}/") else path
        if mapped not in ours:
            raise BuildError(f"upstream file {path} is missing from the built wheel")
