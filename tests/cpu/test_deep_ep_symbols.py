"""deep_ep_cpp against torch 2.11.0: every symbol the extension needs from torch is defined by torch's libraries.

DeepEP's extension is built against one torch; beside another it fails at import with an undefined symbol (on a GPU
host, minutes into a start). Checked here without a GPU: the undefined dynamic symbols of the pinned wheel's
`deep_ep_cpp*.so` (`nm -D`, binutils, which the build's gcc brings) against those the real torch 2.11.0 wheel's
libraries export (pinned in build/pins.toml [verify.torch]: PyPI's CPython 3.12 wheel, the CUDA 13 build the GPU host
runs, 506 MiB, downloaded once into the sha256-keyed cache). Only the libraries deep_ep_cpp names are read, each
extracted to a scratch folder, read and deleted.

Which symbols are torch's: everything the extension needs that is not versioned by the C/C++ runtime (GLIBC_*,
GLIBCXX_*, CXXABI_*, GCC_*), by the CUDA runtime (libcudart.so.13) or by NVSHMEM, not a CUDA driver entry point
(cu*, from libcuda.so.1) and not Python's C API. Ten of them are unversioned std:: members (std::string,
std::exception_ptr, std::ios_base_library_init) that the builder's toolchain left unversioned: torch's libc10.so and
libtorch_cpu.so export them, which is what resolves std::ios_base_library_init (GCC 13's libstdc++) on a host whose
libstdc++ is older. The CUDA-only torch symbols are c10::cuda's (libc10_cuda.so): checked
like the others, against the CUDA build's own library. The CUDA runtime, NVSHMEM and driver symbols are not torch's
and are not resolved here (their libraries come from other wheels, and the driver from the host): the test pins
which libraries and symbol versions they are, so that a pin that needs another CUDA or NVSHMEM is seen.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpdist.fetch import fetch
from gpdist.pins import Artifact, Pins

pytestmark = pytest.mark.network

SYSTEM_VERSION = re.compile(r"^(GLIBC|GLIBCXX|CXXABI|GCC)_[0-9.]+$")
PYTHON_API = re.compile(r"^_?Py|^PyExc_")
DRIVER_API = re.compile(r"^cu[A-Z]")
TOOLCHAIN_WEAK = {"__gmon_start__", "_ITM_deregisterTMCloneTable", "_ITM_registerTMCloneTable", "__pthread_key_create"}
TORCH_LIBS = ("libc10.so", "libc10_cuda.so", "libtorch.so", "libtorch_cpu.so", "libtorch_cuda.so", "libtorch_python.so")
SYSTEM_LIBS = {"libstdc++.so.6", "libm.so.6", "libgcc_s.so.1", "libc.so.6", "ld-linux-x86-64.so.2"}
C10_CUDA = "_ZN3c104cuda", "_ZNK3c104cuda"  # c10::cuda:: functions and const methods, mangled


def _nm(lib: Path, which: str) -> list[tuple[str, str]]:
    """(name, version) of the dynamic symbols nm lists as --undefined-only or --defined-only."""
    out = subprocess.run(["nm", "-D", which, str(lib)], capture_output=True, text=True, check=True).stdout
    symbols = []
    for line in out.splitlines():
        name, _, version = line.split()[-1].partition("@")
        symbols.append((name, version.lstrip("@")))
    return symbols


def _needed(lib: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def _extract(wheel: Path, members: list[str], dest: Path) -> list[Path]:
    with zipfile.ZipFile(wheel) as zf:
        out = []
        for member in members:
            target = dest / Path(member).name
            with zf.open(member) as src, target.open("wb") as f:
                shutil.copyfileobj(src, f, 1 << 22)
            out.append(target)
    return out


def _extension_member(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as zf:
        [member] = [n for n in zf.namelist() if n.startswith("deep_ep_cpp") and n.endswith(".so")]
    return member


def classify(name: str, version: str) -> str:
    """Where an undefined symbol of deep_ep_cpp comes from."""
    if SYSTEM_VERSION.match(version) or name in TOOLCHAIN_WEAK:
        return "system"
    if version == "libcudart.so.13":
        return "cudart"
    if version == "NVSHMEM":
        return "nvshmem"
    if version:
        return f"unexpected version {version}"
    if PYTHON_API.match(name):
        return "python"
    if DRIVER_API.match(name):
        return "driver"
    return "torch"


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="gp-deep-ep-symbols-") as d:
        yield Path(d)


def _extension(art: Artifact, scratch: Path) -> Path:
    wheel = fetch(art)
    dest = scratch / art.filename
    dest.mkdir()
    [lib] = _extract(wheel, [_extension_member(wheel)], dest)
    return lib


@pytest.fixture(scope="module")
def extension(pins: Pins, scratch: Path) -> Path:
    """deep_ep_cpp of the pinned CPython 3.12 wheel (the GPU host's)."""
    return _extension(pins.engine("deep_ep").wheel, scratch)


@pytest.fixture(scope="module")
def undefined(extension: Path) -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = {}
    for name, version in _nm(extension, "--undefined-only"):
        out.setdefault(classify(name, version), []).append((name, version))
    return out


@pytest.fixture(scope="module")
def torch_exports(pins: Pins, extension: Path, scratch: Path) -> dict[str, set[str]]:
    """Library name -> the symbols it defines, for each torch library deep_ep_cpp names (extracted one at a time)."""
    art = pins.verify["torch"]
    assert art.filename.startswith(f"torch-{pins.engine('deep_ep').requires_torch}-cp312-cp312-"), art.filename
    wheel = fetch(art)
    exports = {}
    for lib in [n for n in _needed(extension) if n in TORCH_LIBS]:
        [path] = _extract(wheel, [f"torch/lib/{lib}"], scratch)
        exports[lib] = {name for name, _ in _nm(path, "--defined-only")}
        path.unlink()
    return exports


def test_deep_ep_cpp_needs_torch_cuda_13_nvshmem_3_and_the_system_only(extension: Path) -> None:
    assert set(_needed(extension)) == {
        *TORCH_LIBS,
        "libcudart.so.13",
        "libcuda.so.1",
        "libnvshmem_host.so.3",
        *SYSTEM_LIBS,
    }


def test_every_torch_symbol_of_deep_ep_cpp_is_defined_by_torch_2_11_0(
    undefined: dict[str, list[tuple[str, str]]], torch_exports: dict[str, set[str]]
) -> None:
    assert set(torch_exports) == set(TORCH_LIBS), "every torch library deep_ep_cpp names is in the torch wheel"
    wanted = sorted(name for name, _ in undefined["torch"])
    assert len(wanted) >= 50, wanted  # 57 for the pinned wheel: c10, at::_ops, pybind11 casters, THP*, 10 std::
    missing = [name for name in wanted if not any(name in defined for defined in torch_exports.values())]
    assert missing == [], "undefined in torch 2.11.0:\n" + _demangle(missing)


def test_the_cuda_only_torch_symbols_come_from_c10_cuda(
    undefined: dict[str, list[tuple[str, str]]], torch_exports: dict[str, set[str]]
) -> None:
    cuda_only = sorted(name for name, _ in undefined["torch"] if name.startswith(C10_CUDA))
    assert len(cuda_only) == 4, _demangle(cuda_only)  # get/setCurrentCUDAStream, getStreamFromPool, stream()
    assert all(name in torch_exports["libc10_cuda.so"] for name in cuda_only), _demangle(cuda_only)
    # Nothing else the extension needs is CUDA-only: libtorch_cuda.so (NEEDED) provides none of its symbols alone.
    others = set().union(*(v for k, v in torch_exports.items() if k != "libtorch_cuda.so"))
    only_cuda_lib = [name for name, _ in undefined["torch"] if name not in others]
    assert only_cuda_lib == [], _demangle(only_cuda_lib)


def test_every_other_undefined_symbol_is_the_system_python_cuda_runtime_nvshmem_or_the_driver(
    undefined: dict[str, list[tuple[str, str]]],
) -> None:
    assert set(undefined) == {"system", "python", "torch", "cudart", "nvshmem", "driver"}, set(undefined)
    cudart = {name for name, _ in undefined["cudart"]}
    driver = {name for name, _ in undefined["driver"]}
    nvshmem = {name for name, _ in undefined["nvshmem"]}
    # What the runtime's interposer must see for DeepEP's NVL buffers: device memory and its legacy CUDA IPC
    # (cudart), the pinned host counters (cudaHostAlloc, mapped), and the fabric path's VMM calls (driver).
    assert {"cudaMalloc", "cudaFree", "cudaIpcGetMemHandle", "cudaIpcOpenMemHandle", "cudaIpcCloseMemHandle"} <= cudart
    assert {"cudaHostAlloc", "cudaHostGetDevicePointer", "cudaFreeHost"} <= cudart
    assert "cudaMallocHost" not in cudart
    assert {"cuMemCreate", "cuMemMap", "cuMemExportToShareableHandle", "cuMemImportFromShareableHandle"} <= driver
    assert {"nvshmemx_get_uniqueid", "nvshmem_align", "nvshmemid_hostlib_init_attr"} <= nvshmem


def test_the_other_pythons_extensions_need_the_same_torch_symbols(
    pins: Pins, undefined: dict[str, list[tuple[str, str]]], scratch: Path
) -> None:
    """The symbol check reads the CPython 3.12 torch wheel only (each is 506 MiB). The other Pythons' extensions
    need the same torch symbols by name; that their torch 2.11.0 wheels define them too is assumed (the C++ libraries
    are built from one source; libtorch_python.so is per Python)."""
    want = {name for name, _ in undefined["torch"]}
    for art in pins.engine("deep_ep").other_wheels:
        lib = _extension(art, scratch)
        got = {name for name, version in _nm(lib, "--undefined-only") if classify(name, version) == "torch"}
        assert got == want, f"{art.filename}: {_demangle(sorted(got ^ want))}"
        lib.unlink()


def _demangle(names: list[str]) -> str:
    if not names:
        return ""
    return subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout
