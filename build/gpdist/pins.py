"""Typed view of build/pins.toml, the only place versions and digests live."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from gpdist import REPO_ROOT
from gpdist.wheelmeta import WheelName

PINS_PATH = REPO_ROOT / "build" / "pins.toml"


@dataclass(frozen=True)
class Artifact:
    """One file on PyPI, identified by project and file name, trusted only by its sha256."""

    project: str
    filename: str
    sha256: str
    size: int | None = None


ENGINE = "engine"  # a serving engine (vLLM, SGLang): it gets an offline bundle of its own
LIBRARY = "library"  # a package the engines import (DeepEP): patched and built like an engine, bundled with none
KINDS = (ENGINE, LIBRARY)


@dataclass(frozen=True)
class EnginePin:
    """One patched upstream package. `wheel` is the one the series, the hooks, `edit` and `rebase` work on (for a
    package with one wheel per Python, the GPU host's); `other_wheels` are the same release for other Pythons, built
    with the same series and overlay."""

    name: str
    project: str
    version: str
    wheel: Artifact
    sdist: Artifact | None
    commit_wheel: str
    commit_sdist: str
    requires_torch: str
    distribution: str = ""  # our wheel's distribution name, when it differs from upstream's (deep_ep)
    other_wheels: tuple[Artifact, ...] = ()
    kind: str = ENGINE

    @property
    def wheels(self) -> tuple[Artifact, ...]:
        """Every pinned wheel of the release, the primary first."""
        return (self.wheel, *self.other_wheels)

    @property
    def dist_name(self) -> str:
        """The distribution name our wheel carries (file name, dist-info folder, METADATA Name)."""
        return self.distribution or WheelName.parse(self.wheel.filename).distribution

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
    verify: dict[str, Artifact] = field(default_factory=dict)

    def engine(self, name: str) -> EnginePin:
        try:
            return self.engines[name]
        except KeyError:
            known = ", ".join(sorted(self.engines))
            raise SystemExit(f"gpdist: unknown engine {name!r}; pinned engines are: {known}") from None

    def dist_version(self, upstream: str) -> str:
        """Version of a patched engine wheel: upstream version plus our local label."""
        return f"{upstream}+{self.label}.{self.release}"

    def dist_wheel(self, engine: EnginePin, artifact: Artifact | None = None) -> WheelName:
        """The name of the wheel we build from one of the engine's pinned wheels (default: the primary)."""
        upstream = WheelName.parse((artifact or engine.wheel).filename)
        return WheelName(engine.dist_name, self.dist_version(engine.version), upstream.tags)

    @property
    def serving_engines(self) -> tuple[str, ...]:
        """The pinned serving engines (kind "engine"), in pins.toml order: what a bundle of `all` means."""
        return tuple(name for name, e in self.engines.items() if e.kind == ENGINE)

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
        kind = e.get("kind", ENGINE)
        if kind not in KINDS:
            raise SystemExit(f"gpdist: {path}: [engines.{name}] kind = {kind!r}: use one of {', '.join(KINDS)}")
        engines[name] = EnginePin(
            name=name,
            project=e["project"],
            version=e["version"],
            wheel=_artifact(e["project"], e["wheel"]),
            sdist=_artifact(e["project"], e["sdist"]) if "sdist" in e else None,
            commit_wheel=e.get("commit_wheel", ""),
            commit_sdist=e.get("commit_sdist", ""),
            requires_torch=e["requires_torch"],
            distribution=e.get("distribution", ""),
            other_wheels=tuple(_artifact(e["project"], w) for w in e.get("other_wheels", [])),
            kind=kind,
        )
    deps = {}
    for key, d in raw.get("dependencies", {}).items():
        deps[key] = _artifact(d.get("project", key), d["wheel"])
    verify = {key: _artifact(d.get("project", key), d["wheel"]) for key, d in raw.get("verify", {}).items()}
    dist = raw["distribution"]
    return Pins(
        label=dist["label"],
        release=int(dist["release"]),
        source_date_epoch=int(dist["source_date_epoch"]),
        runtime_name=raw["runtime"]["name"],
        runtime_requires_python=raw["runtime"]["requires_python"],
        engines=engines,
        dependencies=deps,
        verify=verify,
    )
