"""The build report written next to the wheels: what was patched, and proof that native code is unchanged."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from gpdist.engine import EngineBuild
from gpdist.pins import Pins


def write_report(pins: Pins, builds: list[EngineBuild], runtime_wheel: Path, out_dir: Path) -> tuple[Path, Path]:
    data = {
        "distribution": f"{pins.label}.{pins.release}",
        "source_date_epoch": pins.source_date_epoch,
        "runtime": {
            "wheel": runtime_wheel.name,
            "sha256": hashlib.sha256(runtime_wheel.read_bytes()).hexdigest(),
        },
        "engines": [
            {**asdict(b), "wheel": b.wheel.name, "native_files_unchanged": len(b.native_files)} for b in builds
        ],
    }
    json_path = out_dir / "build-report.json"
    json_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")

    lines = [f"# Build report: distribution {pins.label}.{pins.release}", ""]
    lines += ["| wheel | sha256 |", "|---|---|"]
    for b in builds:
        lines.append(f"| {b.wheel.name} | `{b.wheel_sha256}` |")
    lines.append(f"| {runtime_wheel.name} | `{data['runtime']['sha256']}` |")
    several = {b.engine for b in builds if sum(c.engine == b.engine for c in builds) > 1}
    for b in builds:
        lines += [
            "",
            f"## {b.engine}" + (f": {b.wheel.name}" if b.engine in several else ""),
            "",
            f"- upstream: `{b.upstream_wheel}` sha256 `{b.upstream_sha256}`",
            f"- patches applied (zero fuzz): {', '.join(b.patches) or 'none'}",
            f"- patched files: {', '.join(b.patched_files) or 'none'}",
            f"- overlay files: {', '.join(b.overlay_files) or 'none'}",
            f"- metadata rewritten: {', '.join(b.metadata_files)}",
            f"- byte-identical to upstream: {b.unchanged_files} files, of which {len(b.native_files)} native",
            "",
            "| native file (unchanged, verified against upstream RECORD) | sha256 |",
            "|---|---|",
        ]
        lines += [f"| {path} | `{digest}` |" for path, digest in sorted(b.native_files.items())]
    md_path = out_dir / "BUILD-REPORT.md"
    md_path.write_text("\n".join(lines) + "\n")
    return json_path, md_path
