"""Typed view of build/pins.toml, the only place versions and digests live."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from gpdist import REPO_ROOT

PINS_PATH = REPO_ROOT / "build" / "pins.toml"


@dataclass(frozen=True)
class Artifact:
    """One file on PyPI, identified by project and file name, trusted only by its sha256."""

    project: str
    filename: str
    sha256: str
    size: int | None = None


@dataclass(frozen=True)
class EnginePin:
    name: str
    project: str
    version: str
    wheel: Artifact
    sdist: Artifact | None
    commit_wheel: str
    commit_sdist: str
    requires_torch: str

    @property
    def patches_dir(self) -> Path:
        return REPO_ROOT / "patches" / self.name

    @property
    def overlay_dir(self) -> Path:
        return REPO_ROOT / "overlays" / self.name


@dataclass(frozen=True)
class Pins:
    label: str
    release: int
    source_date_epoch: int
    runtime_name: str
    runtime_requires_python: str
    engines: dict[str, EnginePin]
    dependencies: dict[str, Artifact]

    def engine(self, name: str) -> EnginePin:
        try:
            return self.engines[name]
        except KeyError:
            known = ", ".join(sorted(self.engines))
            raise SystemExit(f"gpdist: unknown engine {name!r}; pinned engines are: {known}") from None

    def dist_version(self, upstream: str) -> str:
        """Version of a patched engine wheel: upstream version plus our local label."""
        return f"{upstream}+{self.label}.{self.release}"

    @property
    def runtime_python_floor(self) -> tuple[int, int]:
        """The oldest Python the runtime wheel supports: what its import tests and the static check target."""
        match = re.fullmatch(r">=\s*(\d+)\.(\d+)", self.runtime_requires_python.strip())
        if not match:
            raise SystemExit(
                f"gpdist: build/pins.toml [runtime] requires_python = {self.runtime_requires_python!r}: "
                'write it as ">=MAJOR.MINOR" (the checks and tests read the floor from it)'
            )
        return int(match[1]), int(match[2])

    @property
    def runtime_version(self) -> str:
        """The runtime wheel carries the distribution release as its version."""
        return str(self.release)


def engine_names(path: Path = PINS_PATH) -> tuple[str, ...]:
    """The pinned engines, in pins.toml order: what `--engine all` means everywhere."""
    return tuple(load(path).engines)


def _artifact(project: str, table: dict) -> Artifact:
    return Artifact(
        project=table.get("project", project),
        filename=table["filename"],
        sha256=table["sha256"].lower(),
        size=table.get("size"),
    )


def load(path: Path = PINS_PATH) -> Pins:
    with path.open("rb") as f:
        raw = tomllib.load(f)
    engines = {}
    for name, e in raw["engines"].items():
        engines[name] = EnginePin(
            name=name,
            project=e["project"],
            version=e["version"],
            wheel=_artifact(e["project"], e["wheel"]),
            sdist=_artifact(e["project"], e["sdist"]) if "sdist" in e else None,
            commit_wheel=e.get("commit_wheel", ""),
            commit_sdist=e.get("commit_sdist", ""),
            requires_torch=e["requires_torch"],
        )
    deps = {}
    for key, d in raw.get("dependencies", {}).items():
        deps[key] = _artifact(d.get("project", key), d["wheel"])
    dist = raw["distribution"]
    return Pins(
        label=dist["label"],
        release=int(dist["release"]),
        source_date_epoch=int(dist["source_date_epoch"]),
        runtime_name=raw["runtime"]["name"],
        runtime_requires_python=raw["runtime"]["requires_python"],
        engines=engines,
        dependencies=deps,
    )
