"""The live side of validation: facts about this host and process that can be known without the engine.

Everything here must work without torch, without CUDA and without a GPU (the CLI and CI run there), and must
not create a CUDA context (an engine's parent process may fork workers afterwards). So torch is consulted only
when the process already imported it; otherwise its installed metadata is read. GPU facts come from
nvidia-smi, the driver's API version from libcuda's cuDriverGetVersion, which needs no cuInit.

A fact that cannot be learned is left out, not set to None: None means "unset" (for environment pins) and
would be compared; a missing fact is reported by `graphpersist check` as not checked, and refuses a LOAD.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from graphpersist import __version__
from graphpersist.manifest import FORMAT_VERSION, World

# Variables that change what NCCL, torch symmetric memory, NVSHMEM or the CUDA runtime do inside a graph, or
# which device a rank lands on. Recorded at SAVE (unset ones as None) and compared one by one at LOAD.
ENGINE_ENV_PINS: Final = (
    "NCCL_NVLS_ENABLE",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_P2P_LEVEL",
    "NCCL_CUMEM_ENABLE",
    "NCCL_GRAPH_REGISTER",
    "NCCL_LOCAL_REGISTER",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "NVSHMEM_DISABLE_NVLS",
    "CUDA_MODULE_LOADING",
    "CUDA_VISIBLE_DEVICES",
    "PYTORCH_CUDA_ALLOC_CONF",
    "CUBLAS_WORKSPACE_CONFIG",
)
# The runtime's own knobs that shape the address space. GRAPHPERSIST_MODE / GRAPHPERSIST_DIR and logging are
# deliberately not pinned: they differ between SAVE and LOAD by design and do not change the graphs.
RUNTIME_ENV_PINS: Final = ("GP_REGION_BASE", "GP_REGION_SIZE")
PINNED_ENV: Final = ENGINE_ENV_PINS + RUNTIME_ENV_PINS

_SMI_TIMEOUT_S = 10


def pinned_env(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """Each pinned variable's value, None where it is unset."""
    environ = os.environ if environ is None else environ
    return {name: environ.get(name) for name in PINNED_ENV}


def collect_live(*, device: int = 0, environ: Mapping[str, str] | None = None, **overrides: Any) -> dict[str, Any]:
    """The live facts, nested like the manifest, with the caller's engine facts merged over them.

    The engine passes what only it knows, e.g. ``collect_live(engine={...}, parallel={...}, model={...},
    capture={...}, region={...}, flags={...})``; mappings merge key by key, a key with dots sets that leaf.
    """
    live: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "distribution": {"version": __version__},
        "python": {"version": platform.python_version()},
    }
    _put(live, "torch.version", torch_version())
    _put(live, "cuda.runtime", torch_cuda_runtime())
    gpus = _smi_gpus()
    _put(live, "cuda.driver", gpus[0].get("driver_version") if gpus else None)
    _put(live, "cuda.driver_api", driver_api_version())
    _put(live, "nccl.version", nccl_version())
    model, capability = gpu_facts(device, gpus, environ)
    _put(live, "gpu.model", model)
    _put(live, "gpu.compute_capability", capability)
    live["env"] = pinned_env(environ)
    merge(live, overrides)
    return live


def merge(facts: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Merges `overrides` into `facts` in place (mappings key by key, dotted keys as paths); returns `facts`."""
    for key, value in overrides.items():
        if "." in key:
            set_field(facts, key, value)
        elif isinstance(value, Mapping) and isinstance(facts.get(key), dict):
            merge(facts[key], value)
        elif isinstance(value, Mapping):
            facts[key] = merge({}, value)
        else:
            facts[key] = value
    return facts


def set_field(facts: dict[str, Any], dotted: str, value: Any) -> None:
    """Sets one leaf by its dotted name, creating the mappings on the way ("parallel.tp_size")."""
    *parents, leaf = dotted.split(".")
    node = facts
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[leaf] = value


def world_facts(live: Mapping[str, Any]) -> dict[str, Any]:
    """The subset of `live` that forms the manifest's World (what ArchiveWriter takes), dropping the rest.

    SAVE calls ``ArchiveWriter(root, world_facts(collect_live(...)))`` so that SAVE records exactly what LOAD
    will later collect and compare.
    """
    return _project(World, live)


def _project(tp: Any, value: Any) -> Any:
    if not (dataclasses.is_dataclass(tp) and isinstance(value, Mapping)):
        return value
    hints = typing.get_type_hints(tp)
    return {f.name: _project(hints[f.name], value[f.name]) for f in dataclasses.fields(tp) if f.name in value}


def _put(facts: dict[str, Any], dotted: str, value: Any) -> None:
    if value is not None:
        set_field(facts, dotted, value)


# ---------------------------------------------------------------------------------------------------------
# Probes. Each returns None when it cannot tell; none raises.


def torch_version() -> str | None:
    torch = sys.modules.get("torch")
    if torch is not None:
        return str(getattr(torch, "__version__", "")) or None
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_cuda_runtime() -> str | None:
    """The CUDA runtime version torch was built with, read from torch/version.py without importing torch."""
    torch = sys.modules.get("torch")
    if torch is not None:
        with contextlib.suppress(Exception):
            return torch.version.cuda
        return None
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        with contextlib.suppress(OSError):
            text = (Path(location) / "version.py").read_text()
            match = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
            return match.group(1) if match else None
    return None


def nccl_version() -> str | None:
    """NCCL as torch loaded it when torch is imported, else the installed nvidia-nccl wheel's version."""
    torch = sys.modules.get("torch")
    if torch is not None:
        with contextlib.suppress(Exception):
            version = torch.cuda.nccl.version()
            return ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)
    for dist in ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist)
    return None


def driver_api_version() -> str | None:
    """cuDriverGetVersion as "major.minor" (e.g. 12080 -> "12.8"); needs libcuda, not cuInit or a GPU."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value <= 0:
            return None
    except (OSError, AttributeError):
        return None
    return f"{version.value // 1000}.{(version.value % 1000) // 10}"


def gpu_facts(
    device: int, gpus: list[dict[str, str]] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[str | None, str | None]:
    """(model, compute capability "9.0") of CUDA device `device`, as this process would number it.

    torch answers when it already initialised CUDA; otherwise nvidia-smi's list is mapped through
    CUDA_VISIBLE_DEVICES. When the mapping is unclear but all visible GPUs are alike, their model is the answer.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        with contextlib.suppress(Exception):
            if torch.cuda.is_initialized():
                major, minor = torch.cuda.get_device_capability(device)
                return torch.cuda.get_device_name(device), f"{major}.{minor}"
    gpus = _smi_gpus() if gpus is None else gpus
    if not gpus:
        return None, None
    if len({(g.get("name"), g.get("compute_cap")) for g in gpus}) == 1:
        pick: dict[str, str] | None = gpus[0]  # all alike: whichever device it is, the answer is the same
    else:
        pick = _nth_visible(device, gpus, os.environ if environ is None else environ)
    if pick is None:
        return None, None
    return pick.get("name") or None, pick.get("compute_cap") or None


def _nth_visible(device: int, gpus: list[dict[str, str]], environ: Mapping[str, str]) -> dict[str, str] | None:
    """nvidia-smi's row for CUDA device `device`, or None where CUDA's numbering cannot be reproduced.

    UUIDs are unambiguous; plain indices follow nvidia-smi's PCI order only with CUDA_DEVICE_ORDER=PCI_BUS_ID
    (CUDA's default numbers the fastest device first).
    """
    pci_order = environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID"
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        order = gpus if pci_order else []
    else:
        order = []
        for item in (v.strip() for v in visible.split(",") if v.strip()):
            if item.startswith(("GPU-", "MIG-")):
                match = [g for g in gpus if g.get("uuid", "").startswith(item)]
            else:
                match = [g for g in gpus if pci_order and g.get("index") == item]
            if len(match) != 1:
                return None
            order.append(match[0])
    return order[device] if 0 <= device < len(order) else None


def _smi_gpus() -> list[dict[str, str]]:
    """nvidia-smi's GPU list (index, uuid, name, driver_version, compute_cap); [] without a working nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    for fields in (
        ("index", "uuid", "name", "driver_version", "compute_cap"),
        ("index", "uuid", "name", "driver_version"),
    ):
        try:
            proc = subprocess.run(
                [smi, f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=_SMI_TIMEOUT_S,
            )
        except (OSError, subprocess.SubprocessError):
            return []
        if proc.returncode == 0:
            rows = [[c.strip() for c in line.split(",")] for line in proc.stdout.splitlines() if line.strip()]
            return [dict(zip(fields, row, strict=False)) for row in rows if len(row) == len(fields)]
    return []
