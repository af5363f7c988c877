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
from graphpersist.archive.manifest import FORMAT_VERSION, World

# Variables that change what NCCL, torch symmetric memory, NVSHMEM or the CUDA runtime put into a graph, or which
# GPU a rank lands on. Recorded at SAVE (unset ones as None) and compared one by one at LOAD.
#
# Where the NCCL names come from: NCCL's own source at the pinned release (github.com/NVIDIA/nccl, tag
# v2.28.9-1: the reference host's nvidia-nccl-cu13 2.28.9); every name below is read there by an NCCL_PARAM(...)
# or ncclGetEnv("NCCL_...") in the files named after each group. NCCL also reads
# NCCL_CONF_FILE (or ~/.nccl.conf) and /etc/nccl.conf for variables not set in the environment
# (src/misc/param.cc): the file's path is pinned, its contents are not (see the README).
NCCL_ENV_PINS: Final = (
    # buffers and their chunking (src/init.cc, src/misc/cudawrap.cc)
    "NCCL_BUFFSIZE",
    "NCCL_LL_BUFFSIZE",
    "NCCL_LL128_BUFFSIZE",
    "NCCL_P2P_NVL_CHUNKSIZE",
    "NCCL_P2P_PCI_CHUNKSIZE",
    "NCCL_P2P_NET_CHUNKSIZE",
    "NCCL_WORK_FIFO_BYTES",
    "NCCL_CUMEM_ENABLE",
    "NCCL_CUMEM_HOST_ENABLE",
    # algorithm, protocol and tuning (src/enqueue.cc, src/graph/tuning.cc, src/plugin/tuner.cc)
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_PAT_ENABLE",
    "NCCL_P2P_LL_THRESHOLD",
    "NCCL_TUNER_PLUGIN",
    # threads, channels and CTAs per collective (src/graph/tuning.cc, src/graph/connect.cc, src/graph/paths.cc,
    # src/init.cc, src/sym_kernels.cc)
    "NCCL_NTHREADS",
    "NCCL_LL128_NTHREADS",
    "NCCL_MIN_NCHANNELS",
    "NCCL_MAX_NCHANNELS",
    "NCCL_MAX_P2P_NCHANNELS",
    "NCCL_MIN_CTAS",
    "NCCL_MAX_CTAS",
    "NCCL_CTA_POLICY",
    "NCCL_SYM_CTAS",
    # transports and topology (src/graph/paths.cc, src/transport/{p2p,shm,nvls}.cc, src/init.cc, src/graph/topo.cc)
    "NCCL_P2P_LEVEL",
    "NCCL_P2P_DISABLE",
    "NCCL_P2P_DIRECT_DISABLE",
    "NCCL_P2P_READ_ENABLE",
    "NCCL_P2P_USE_CUDA_MEMCPY",
    "NCCL_SHM_DISABLE",
    "NCCL_SHM_USE_CUDA_MEMCPY",
    "NCCL_NET_GDR_LEVEL",
    "NCCL_NVB_DISABLE",
    "NCCL_NVLS_ENABLE",
    "NCCL_MNNVL_ENABLE",
    "NCCL_TOPO_FILE",
    # connection timing: lazy (at first use) or up-front connection decides when buffers are allocated (src/init.cc)
    "NCCL_RUNTIME_CONNECT",
    # buffer registration and what NCCL adds to captured graphs (src/enqueue.cc, src/register/register.cc,
    # src/init.cc, src/misc/strongstream.cc)
    "NCCL_GRAPH_REGISTER",
    "NCCL_LOCAL_REGISTER",
    "NCCL_WIN_ENABLE",
    "NCCL_GRAPH_MIXING_SUPPORT",
    "NCCL_LAUNCH_ORDER_IMPLICIT",
    "NCCL_MEM_SYNC_DOMAIN",
    # where NCCL reads further settings from (src/misc/param.cc)
    "NCCL_CONF_FILE",
)
# torch's NCCL process group and symmetric memory (names as torch's source reads them: c10d/ProcessGroupNCCL.hpp,
# c10d/symm_mem/CUDASymmetricMemoryUtils.cpp; the backend switch is TORCH_SYMMMEM), NVSHMEM (NVLS, heap size),
# which GPU a device index means, the CUDA module loader and torch's allocator.
ENGINE_ENV_PINS: Final = (
    *NCCL_ENV_PINS,
    "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK",  # registers every allocation with NCCL (user buffers)
    "TORCH_NCCL_NAN_CHECK",  # adds a NaN-check kernel before each collective
    "TORCH_SYMMMEM",  # symmetric-memory backend: CUDA, NVSHMEM or NCCL
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "GRAPHPERSIST_SYMM_MEM_NO_MULTICAST",  # SGLang patch 0007: symmetric memory's two-shot all-reduce without it
    "NVSHMEM_DISABLE_NVLS",
    "NVSHMEM_SYMMETRIC_SIZE",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",  # with CUDA_VISIBLE_DEVICES, decides which GPU device N is
    "CUDA_MODULE_LOADING",
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",  # torch's newer name for the same allocator settings
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


def collect_live(
    *, device: int | None = None, environ: Mapping[str, str] | None = None, **overrides: Any
) -> dict[str, Any]:
    """The live facts, nested like the manifest, with the caller's engine facts merged over them.

    The engine passes what only it knows, e.g. ``collect_live(device=local_device, engine={...}, parallel={...},
    model={...}, capture={...}, region={...}, flags={...})``; mappings merge key by key, a key with dots sets
    that leaf. `device` is this rank's CUDA device index; its GPU's identity becomes `device.index`,
    `device.uuid` and `device.pci_bus_id` (those that can be learned). Without `device`, torch's current device
    is used when torch has initialised CUDA, and no device facts are collected otherwise (LOAD then refuses
    them as missing, it never guesses).
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
    if device is None:
        device = _torch_current_device()
    model, capability = gpu_facts(0 if device is None else device, gpus, environ)
    _put(live, "gpu.model", model)
    _put(live, "gpu.compute_capability", capability)
    if device is not None:
        live["device"] = device_facts(device, gpus, environ)
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


def device_facts(
    device: int, gpus: list[dict[str, str]] | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """{"index", "uuid", "pci_bus_id"} of CUDA device `device` as this process numbers it; unknowns left out.

    In a process where torch has initialised CUDA (a rank's own process) the answer is exact: torch's device
    properties, then the driver (cuDeviceGetUuid / cuDeviceGetPCIBusId, safe once CUDA is initialised), then
    nvidia-smi's row for that UUID. Elsewhere nvidia-smi's list is mapped through CUDA_VISIBLE_DEVICES /
    CUDA_DEVICE_ORDER where that mapping is unambiguous. Never initialises CUDA or creates a context.
    """
    facts: dict[str, Any] = {"index": device}
    if _torch_current_device() is not None:  # torch imported and CUDA initialised in this process
        for found in (_torch_device_ids(device), _driver_device_ids(device)):
            for key, value in found.items():
                facts.setdefault(key, value)
    if "uuid" in facts and "pci_bus_id" in facts:
        return facts
    gpus = _smi_gpus() if gpus is None else gpus
    if "uuid" in facts:
        rows = [g for g in gpus if normal_uuid(g.get("uuid", "")) == facts["uuid"]]
        row = rows[0] if len(rows) == 1 else None
    else:
        row = _nth_visible(device, gpus, os.environ if environ is None else environ) if gpus else None
    if row is not None:
        _put(facts, "uuid", facts.get("uuid") or normal_uuid(row.get("uuid", "")))
        _put(facts, "pci_bus_id", normal_pci_bus_id(row.get("pci.bus_id", "")))
    return facts


def _torch_device_ids(device: int) -> dict[str, str]:
    """UUID and PCI bus id from torch's device properties (newer torch has the PCI ids), as far as they go."""
    out: dict[str, str] = {}
    torch = sys.modules.get("torch")
    with contextlib.suppress(Exception):
        props = torch.cuda.get_device_properties(device)  # type: ignore[union-attr]
        _put(out, "uuid", normal_uuid(str(getattr(props, "uuid", ""))))
        ids = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
        if all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            _put(out, "pci_bus_id", normal_pci_bus_id("{:x}:{:x}:{:x}.0".format(*ids)))
    return out


def _driver_device_ids(device: int) -> dict[str, str]:
    """UUID and PCI bus id from libcuda; only called where CUDA is initialised (device = driver ordinal)."""
    out: dict[str, str] = {}
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        handle = ctypes.c_int(0)
        if libcuda.cuDeviceGet(ctypes.byref(handle), ctypes.c_int(device)) != 0:
            return out
        bus = ctypes.create_string_buffer(64)
        if libcuda.cuDeviceGetPCIBusId(bus, ctypes.c_int(len(bus)), handle) == 0:
            _put(out, "pci_bus_id", normal_pci_bus_id(bus.value.decode(errors="replace")))
        raw = (ctypes.c_ubyte * 16)()
        get_uuid = getattr(libcuda, "cuDeviceGetUuid_v2", None) or libcuda.cuDeviceGetUuid
        if get_uuid(raw, handle) == 0:
            _put(out, "uuid", uuid_from_bytes(bytes(raw)))
    except (OSError, AttributeError):
        pass
    return out


def uuid_from_bytes(raw: bytes) -> str:
    """The 16 bytes of a CUuuid in nvidia-smi's form, "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"."""
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def normal_uuid(text: str) -> str | None:
    """A GPU UUID in nvidia-smi's form, "GPU-<8-4-4-4-12 hex>" (torch prints it without the prefix)."""
    text = text.strip()
    prefix = text[:4].upper()
    body = text[4:] if prefix in ("GPU-", "MIG-") else text
    if not re.fullmatch(r"[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}", body):
        return None
    return (prefix if prefix in ("GPU-", "MIG-") else "GPU-") + body.lower()


def normal_pci_bus_id(text: str) -> str | None:
    """A PCI address in sysfs' form, "0000:19:00.0" (nvidia-smi prints "00000000:19:00.0", CUDA upper case)."""
    match = re.fullmatch(r"([0-9a-fA-F]{1,8}):([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])", text.strip())
    if match is None:
        return None
    domain, bus, dev, fn = match.groups()
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{fn}"


def _torch_current_device() -> int | None:
    """torch's current CUDA device where torch has already initialised CUDA; None otherwise (no context made)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    with contextlib.suppress(Exception):
        if torch.cuda.is_initialized():
            return int(torch.cuda.current_device())
    return None


def _nth_visible(device: int, gpus: list[dict[str, str]], environ: Mapping[str, str]) -> dict[str, str] | None:
    """nvidia-smi's row for CUDA device `device`, or None where CUDA's numbering cannot be reproduced.

    UUIDs are unambiguous; plain indices follow nvidia-smi's PCI order only with CUDA_DEVICE_ORDER=PCI_BUS_ID
    (CUDA's default numbers the fastest device first). A host with one GPU and no CUDA_VISIBLE_DEVICES is
    unambiguous too.
    """
    pci_order = environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID"
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        order = gpus if pci_order or len(gpus) == 1 else []
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
    """nvidia-smi's GPU list (index, uuid, name, driver_version, pci.bus_id, compute_cap); [] without nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    for fields in (
        ("index", "uuid", "name", "driver_version", "pci.bus_id", "compute_cap"),
        ("index", "uuid", "name", "driver_version", "pci.bus_id"),
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
